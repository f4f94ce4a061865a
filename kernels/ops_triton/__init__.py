"""The triton backend: one file per op, same names as the other backends."""
