"""The psp scheduling core (flowpacer/kernel/kmod/psp_sched.h) compiled in user space against a virtual clock:
deterministic tests and benchmarks of the same code the module runs."""
