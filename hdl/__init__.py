"""Amaranth gateware of the NPU: configuration, ISA, components and the top level.

``hdl`` never imports ``sim``, ``tb`` or ``firmware``; those packages import ``hdl.config`` and ``hdl.isa``.
"""
