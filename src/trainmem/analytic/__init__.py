"""trainmem.analytic."""
