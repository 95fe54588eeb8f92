# `make demo`: install, make a backbone offline, run PerAda on Fashion-MNIST (a few minutes on 2 CPU cores).
# `make test`: install what the tests need and run the whole suite (what CI runs).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# The `peradapt` command that `pip install` puts beside this Python (a venv's bin/), as a user runs it.
PERADAPT = $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/peradapt
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
DEMO_RUN ?= runs/demo

.PHONY: install install-test fmnist demo test lint settings-doc method-api-doc gpu-check

install:
	$(PIP) install -e .

install-test:
	$(PIP) install -e '.[test]'

# Debian packages Fashion-MNIST; elsewhere pass --data-dir to a directory holding the IDX files.
fmnist:
	@test -f $(FMNIST) || $(SUDO) apt-get install -y dataset-fashion-mnist \
		|| ($(SUDO) apt-get update && $(SUDO) apt-get install -y dataset-fashion-mnist)

demo: install fmnist
	$(PERADAPT) pretrain --data fmnist --backbone resnet18_w16 --epochs 2
	rm -rf $(DEMO_RUN)
	$(PERADAPT) train --config examples/fmnist-demo.yaml --out $(DEMO_RUN)

# The real Fashion-MNIST lets a few more tests run; without it they are skipped, so a failed install is no error.
# One pytest-xdist worker per core, a test file to a worker (its module fixtures, such as trained runs, made once).
TEST_WORKERS ?= logical
test: install-test
	-@$(MAKE) --no-print-directory fmnist
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: install-test
	ruff check . && ruff format --check .

# docs/SETTINGS.md, generated from the settings' declarations (tests/test_settings.py checks that it is current).
settings-doc:
	$(PYTHON) -c "from peradapt.options import settings_markdown; print(settings_markdown(), end='')" > docs/SETTINGS.md

# docs/METHOD_API.md, generated from the docstrings of what a method may use (tests/test_method_reference.py checks
# that it is current).
method-api-doc:
	$(PYTHON) -c "from peradapt.methods.reference import reference_markdown; print(reference_markdown(), end='')" \
		> docs/METHOD_API.md

# On a machine with a CUDA GPU, no network needed: the tests marked cuda, then the GPU benchmark figures, in one
# JSON (gpu-check.json). Installs without dependencies when they are there already (an offline GPU box).
gpu-check:
	$(PIP) install -e '.[test]' || $(PIP) install -e . --no-deps --no-build-isolation
	$(PYTHON) benchmarks/gpu_check.py --json gpu-check.json
