"""The qemu TCG test VM harness (see vm/README.md)."""
