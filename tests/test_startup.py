"""What starting peradapt imports (issue 34, item 5): `import peradapt` and the commands that only print help or list
methods import none of the heavy stacks, while exported adapters and backbones still load after `import peradapt` with
plain PEFT and timm, in whichever order they are imported. Each check runs in a fresh interpreter, since this one has
imported everything already. Which modules are imported is checked, never how long it takes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import peradapt
from peradapt.adapters import inject_adapters
from peradapt.backbones import create_backbone, freeze
from peradapt.registry import BUILT_IN, METHODS

# What no help text or method listing needs: the model stacks (PEFT imports transformers and torchvision), and the
# extras that single commands import where they use them.
HEAVY = ("timm", "peft", "transformers", "torchvision", "matplotlib", "optuna", "sklearn", "scipy", "datasets", "flwr")
TINY = "resnet10_w4"


def run_python(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def imported_by(code: str) -> set[str]:
    """The top-level packages imported once `code` has run in a fresh interpreter."""
    out = run_python(code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))")
    return {name.partition(".")[0] for name in json.loads(out.splitlines()[-1])}


def imported_by_command(args: list[str], tmp_path: Path) -> set[str]:
    """The top-level packages imported once `peradapt ARGS` has finished (`peradapt.cli.main`, as the script runs)."""
    listing = tmp_path / "modules.json"
    run_python(
        """
        import json, sys
        from peradapt.cli import main

        listing, sys.argv = sys.argv[1], ["peradapt", *sys.argv[2:]]
        try:
            main()
        except SystemExit as exit_:
            assert not exit_.code, f"exit code {exit_.code}"
        with open(listing, "w") as file:
            json.dump(sorted(sys.modules), file)
        """,
        str(listing),
        *args,
    )
    return {name.partition(".")[0] for name in json.loads(listing.read_text())}


def test_import_peradapt_imports_no_model_stack():
    imported = imported_by("import peradapt")
    assert not imported & {"torch", "numpy", *HEAVY}


@pytest.mark.parametrize("args", [["--help"], ["methods"], ["methods", "perada"], ["train", "--help"]])
def test_help_and_method_listings_import_no_heavy_stack(args, tmp_path):
    assert not imported_by_command(args, tmp_path) & set(HEAVY)


def test_help_imports_no_torch(tmp_path):
    assert "torch" not in imported_by_command(["--help"], tmp_path)


def test_the_registry_knows_every_built_in_method_when_first_read():
    """No module imports the methods before the registry is read: it imports them then, with their settings."""
    built_in = sorted(name for name in METHODS if METHODS.source(name) == BUILT_IN)
    out = run_python(
        """
        import json, sys
        from peradapt.config import find_setting
        from peradapt.registry import METHODS

        assert "peradapt.methods" not in sys.modules
        print(json.dumps([sorted(METHODS), find_setting("feddyn_alpha").flag_name]))
        """
    )
    names, flag = json.loads(out)
    assert set(built_in) <= set(names) and flag == "--feddyn-alpha"


def test_the_package_exports_every_name():
    for name in peradapt.__all__:
        assert getattr(peradapt, name) is not None
    from peradapt import AdaptedModel, LocalSGDMethod, Method, TrainConfig, inject_adapters, method_class, register

    assert issubclass(LocalSGDMethod, Method) and method_class("fedavg").name == "fedavg"
    assert callable(inject_adapters) and callable(register) and AdaptedModel and TrainConfig
    with pytest.raises(AttributeError):
        peradapt.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    "imports",
    ["import peradapt\nimport peft\nimport timm", "import peft\nimport timm\nimport peradapt"],
    ids=["peradapt-first", "peradapt-last"],
)
def test_an_exported_adapter_loads_with_plain_peft_and_timm(imports, tmp_path):
    """The model cards' recipe in a fresh interpreter: `import peradapt`, then timm builds the narrow ResNet by name
    and PEFT rebuilds the residual adapter, to the logits peradapt computed."""
    torch.manual_seed(0)
    backbone = freeze(create_backbone(TINY, num_classes=3, in_chans=1))
    torch.save(backbone.state_dict(), tmp_path / "backbone.pt")
    model = inject_adapters(backbone, "residual", dropout=0.0, lora_rank=2)
    state = model.state()
    generator = torch.Generator().manual_seed(2)
    for name in model.trainable_parameters():  # an adapter that changes the function
        state[name] = state[name] + 0.1 * torch.randn(state[name].shape, generator=generator)
    model.load_state(state)
    model.save_pretrained(tmp_path / "adapter", state)
    images = torch.randn(4, 1, 16, 16, generator=generator)
    model.eval()
    with torch.no_grad():
        torch.save({"images": images, "logits": model(images)}, tmp_path / "expected.pt")
    out = run_python(
        imports
        + textwrap.dedent(
            f"""
            import sys
            import torch

            directory = sys.argv[1]
            backbone = timm.create_model("{TINY}", num_classes=3, in_chans=1)
            backbone.load_state_dict(torch.load(directory + "/backbone.pt"))
            model = peft.PeftModel.from_pretrained(backbone, directory + "/adapter").eval()
            expected = torch.load(directory + "/expected.pt")
            with torch.no_grad():
                logits = model(expected["images"])
            print(torch.allclose(logits, expected["logits"], atol=1e-5), type(model.base_model.model).__name__)
            """
        ),
        str(tmp_path),
    )
    assert out.split() == ["True", "ResNet"]
    plain = create_backbone(TINY, num_classes=3, in_chans=1).eval()  # the adapter is what changes the logits
    plain.load_state_dict(torch.load(tmp_path / "backbone.pt"))
    with torch.no_grad():
        assert not torch.allclose(plain(images), torch.load(tmp_path / "expected.pt")["logits"], atol=1e-3)


def test_timm_builds_peradapts_backbones_by_name_after_import_peradapt():
    """The post-import hook wraps timm's loader only while timm runs: importlib.resources and inspect read timm's own
    loader afterwards."""
    out = run_python(
        """
        import peradapt
        import timm

        print(type(timm.create_model("resnet18_w16")).__name__, type(timm.create_model("vit_tiny_p4_32")).__name__)
        print(type(timm.__loader__).__name__, type(timm.__spec__.loader).__name__)
        """
    )
    assert out.split() == ["ResNet", "VisionTransformer", "SourceFileLoader", "SourceFileLoader"]
