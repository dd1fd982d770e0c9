"""cocotb bench of the AXI4 read DMA (`hdl.axi.AxiReadDma`) and the shared AXI read-memory model."""
