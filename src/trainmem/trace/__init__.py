"""trainmem.trace."""
