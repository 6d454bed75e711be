"""One module per kernel family; each defines FAMILIES (see generator/family.py)."""
