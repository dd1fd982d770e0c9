"""cocotb bench of hdl.ddrwrite.DdrWriter."""
