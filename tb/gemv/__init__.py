"""cocotb bench of the GEMV engine (`hdl.gemv.GemvEngine`) with one AXI read memory per weight port."""
