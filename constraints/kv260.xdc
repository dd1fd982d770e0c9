# KV260 (XCK26-SFVC784-2LV-C): the NPU core built alone, out of context (python -m hdl.build --top npu):
# its single clock domain at 300 MHz (hdl.config kv260 clock_hz) on the core's clk port. In the system
# (hdl/kv260.py) the same clock comes from the MMCM on the PS's pl_clk0.
create_clock -name clk -period 3.333 [get_ports clk]
