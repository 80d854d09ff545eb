"""Which cases a change reaches: the launch map (what kernel code each case runs), the kernel sources'
functions, and git (for `--changed`, mutants and bisect)."""
