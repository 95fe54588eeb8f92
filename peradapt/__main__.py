"""`python -m peradapt` runs the command line, for environments where the `peradapt` script is not on PATH."""

from peradapt.cli import main

main()
