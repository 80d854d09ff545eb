"""The reusable op and block checks: each draws nothing, takes a backend and inputs, and raises
AssertionError naming the op (ops.py); opcheck.py measures a block's recorded op calls the same way,
harness.py runs one op as the unit rung does, blockrun.py one decoder block as the model does; edges.py
derives a kernel's edge shapes from its tiling constants."""
