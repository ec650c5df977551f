"""Applications built on the library: the CLI's demo and insight runs and the digits data
they train on. The library never imports them (tests/test_structure.py)."""
