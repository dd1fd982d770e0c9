"""cocotb benches of the DDR element streams (`hdl.ddrio`) and of `hdl.fp.F32ToF16`."""
