"""trainmem.allocator."""
