"""trainmem.planner."""
