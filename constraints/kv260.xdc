# KV260 (XCK26-SFVC784-2LV-C): the NPU's single clock domain, 300 MHz (hdl.config kv260 clock_hz).
# In the full design the clock is the PS's pl_clk0; for the core's out-of-context build it is a port.
create_clock -name clk -period 3.333 [get_ports clk]
