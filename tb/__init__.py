"""cocotb benches on the Verilog generated from ``hdl/`` (run with Verilator through ``cocotb_tools.runner``).

The ``@cocotb.test`` modules live here; pytest wrappers under ``tests/`` build and run them. The expected values come
from the golden models in ``sim/``; no bench keeps a private model.
"""
