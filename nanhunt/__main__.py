"""`python -m nanhunt …` — the same as the `nanhunt` command."""

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
