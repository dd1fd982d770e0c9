"""firmware.accuracy's INT4-exact mode really removes the weight rounding: packing the replaced tensors gives
codes and scales that stand for exactly those values."""

import numpy as np

from firmware.accuracy import int4_exact
from firmware.pack import pack
from hdl.config import PRESETS as HW
from sim.config import PRESETS
from sim.numerics import dequantize_weights, unpack_int4
from sim.random_weights import random_tensors


def test_int4_exact_tensors_pack_without_rounding():
    cfg, hw = PRESETS["tiny"], HW["kv260"]
    exact = int4_exact(cfg, random_tensors(cfg, 1, dtype=np.float64), hw)
    image = pack(cfg, exact, hw)
    checked = 0
    for name, e in image.tensors.items():
        if e.format != "int4":
            continue
        rows, cols = e.shape
        raw = image.view("WEIGHTS", e.offset, e.nbytes)
        s = image.view("WEIGHTS", e.scale_offset, e.scale_nbytes).view("<f2")
        if e.layout == 0:
            q, s = unpack_int4(raw.reshape(rows, -1))[:, :cols], s.reshape(rows, -1)
        else:
            q, s = unpack_int4(raw.reshape(cols, rows // 2)).T, s.reshape(-1, rows).T
        np.testing.assert_array_equal(dequantize_weights(q, s, e.group), exact[name], err_msg=name)
        checked += 1
    assert checked > 10
