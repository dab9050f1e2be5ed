"""``python -m mcf``: the ``mcf`` command."""

from mcf.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
