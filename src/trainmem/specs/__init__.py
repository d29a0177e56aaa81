"""trainmem.specs."""
