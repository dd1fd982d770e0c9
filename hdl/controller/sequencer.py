"""What every sequencer shares: the context it reads, its ports, and the vocabulary of its FSM.

A sequencer runs one family of instructions. The controller starts it (``i_start``) with the instruction in
``i_ctx.word`` (and, for the instructions that name one, the descriptor already loaded into ``i_ctx.desc``); it
issues passes on ``o_pass`` and sees each one complete on ``i_done``; it ends the instruction with one
``o_end``: ``code`` NONE retires it, any other code is the instruction's error (``at_engine``: report it at the
pc of the failed async WGEMV, `EngineTracker.o_pc`).
"""

from __future__ import annotations

from contextlib import contextmanager

from amaranth import Cat, Const, Mux, Signal, Value
from amaranth.lib import data, enum, stream, wiring
from amaranth.lib.wiring import In, Out

from ..config import HardwareConfig
from ..dsp import MUL_A_BITS, MUL_B_BITS, DspMacc
from ..fetch import PC_BITS
from ..isa import DESCRIPTOR, FMAP_ENTRY, SCALAR_REGS, DdrRegion, ErrorCode
from ..l2 import l2_geometry
from ..sfu import SfuOp
from .passes import BSrc, Sink, Src, done_layout, pass_layout

__all__ = ["context_layout", "end_layout", "DividerPort", "engine_state_layout", "Sequencer", "Steps", "EndSites",
           "REGIONS", "context_flags", "recode", "product", "PRODUCT_LATENCY"]

REGIONS = tuple(DdrRegion)


def context_layout(hw: HardwareConfig) -> data.StructLayout:
    """The architectural state a sequencer reads: the instruction word and its pc, VL, HD and 1/HD, POSITION,
    TOKEN_ID, EMAX, the scalar registers, the loaded descriptor, the FMAP entry the word's ``shape_ptr``
    names, and the DDR base of every region (by `DdrRegion` value)."""
    return data.StructLayout({
        "word": 64, "pc": PC_BITS, "vl": 32, "hd": 32, "inv_hd": 32, "pos": 32, "token": 32, "emax": 32,
        "s": data.ArrayLayout(32, SCALAR_REGS), "desc": DESCRIPTOR, "fmap": FMAP_ENTRY,
        "base": data.ArrayLayout(64, 1 << DdrRegion.as_shape().width),
    })


def end_layout() -> data.StructLayout:
    return data.StructLayout({"code": ErrorCode, "at_engine": 1})


# the shared divider (`hdl.seq.SeqDivider`) as a sequencer sees it: a start pulse with its operands, then busy
DividerPort = wiring.Signature({"start": Out(1), "num": Out(32), "den": Out(32),
                                "busy": In(1), "q": In(32), "r": In(32)})


def engine_state_layout(hw: HardwareConfig) -> data.StructLayout:
    """What the sequencers that hand over matrices see of `EngineTracker`."""
    return data.StructLayout({"active": 1, "idle": 1, "failed": 1, "code": ErrorCode,
                              "act_n": range(hw.gemv_max_cols + 1)})



class Sequencer(wiring.Component):
    """The ports every sequencer has, plus `extra` (a dict of members)."""

    def __init__(self, hw: HardwareConfig, extra: dict):
        self._hw = hw
        super().__init__({
            "i_ctx": In(context_layout(hw)), "i_start": In(1),
            "o_end": Out(stream.Signature(end_layout(), always_ready=True)),
            "o_pass": Out(stream.Signature(pass_layout(hw))),
            "i_done": In(stream.Signature(done_layout(), always_ready=True)),
            **extra})

    @property
    def hw(self):
        return self._hw


PASS_DEFAULTS = dict(op=SfuOp.COPY, bypass=0, a=Src.L2, b=BSrc.NONE, sink=Sink.L2)


class Steps:
    """The FSM vocabulary of a sequencer (or the controller) issuing passes: used inside ``with m.State``.

    `launch` sends a pass and moves to the state that waits for it (the engine takes it at once: a sequencer
    launches only while the engine is idle or completing); `wait_pass` is such a state; `retire` and `fail` end
    the instruction through `end` (a callable taking the code and ``at_engine``) and go to `idle` (`error`).

    How the pass command's fields are driven, a choice of netlist only (the same command either way):
    ``by_site=False`` assigns them where `launch` is called, so each field is a select per condition around
    each launch; ``by_site=True`` numbers the launches and, in `finish` (called once after the FSM), drives
    each field by one flat choice over the launches that set it. Launches nested deep in checks (ATTN, WGEMV)
    map to far fewer LUTs by site (``docs/architecture.md``, "Utilisation"). By site, the launch that runs is
    a number, each field a case on it; or, with ``one_hot=True``, one select per launch, each field the OR of
    its launches' values gated by their selects: no encoding and decoding of the number between the states'
    conditions and the fields (fewer levels where the launches are few and shallow: the vector sequencer).
    One-hot and registered, a launch in a state entered with `state` that holds no other launch is selected by
    the state alone: its fields are the state's whatever its conditions (a completion, the checks around it),
    which reach the valid only.

    ``registered=True`` (by site only) sends the command from a register: it leaves the cycle after `launch`
    (the engine, idle or completing at the launch, is idle then), and no path runs from the sequencer's state
    and context through the choice of the fields into the engine. The register takes the fields of the site
    whatever the valid, and the payload is 0 while not valid by an AND at the output; `fail` in the cycle of a
    `launch` takes the launch back, so that a check on the cycle's inputs (a completion's flags) reaches the
    valid only, not the fields. The valid is the OR of the launches' selects and NOT the OR of the fails'
    (each a LUT output of its own): no chain through the FSM's statements in their order. A matrix command
    meant to start beside the pass is sent one cycle after its launch too."""

    def __init__(self, m, o_pass, i_done, end, idle="IDLE", error=None, by_site=False, registered=False,
                 one_hot=False, bus_error_state=None):
        self.m, self.o_pass, self.i_done, self._end = m, o_pass, i_done, end
        self.bus_error_state = bus_error_state
        self.idle, self.error, self.by_site = idle, error or idle, by_site
        assert by_site or not registered, "a registered pass command is driven by site"
        self.registered = registered
        self._sites = [None]                 # by site: the fields of each launch; site 0 is none (payload 0)
        self._site = Signal(16, name="pass_site")        # the number of the launch that runs
        self.one_hot = one_hot
        self._site_bits = [None]             # one_hot: each launch's select (high while it runs)
        self._site_states = [None]           # one_hot: the state of each launch (None: not entered with `state`)
        self._state, self._in_state = None, {}   # the state `state` is in; each state's decode
        # registered: the command of the launch in this cycle (all 0 without one), sent from o_pass next cycle
        self._cmd = Signal.like(o_pass.payload, name="pass_cmd") if registered else o_pass.payload
        self._launch = Signal(name="pass_launch") if registered else o_pass.valid
        self._goes, self._backs = [], []     # registered: each launch's and each fail's select
        self._go_states, self._back_states = [], []   # and the `state` each is in (None: not known)
        if registered:
            valid, payload = Signal(name="pass_valid"), Signal.like(o_pass.payload, name="pass_payload")
            m.d.sync += [valid.eq(self._launch), Value.cast(payload).eq(Value.cast(self._cmd))]
            m.d.comb += [o_pass.valid.eq(valid),
                         Value.cast(o_pass.payload).eq(Mux(valid, Value.cast(payload), 0))]
        self._finished = False

    def launch(self, nxt, **fields):
        """Send the pass of `fields` (`PASS_DEFAULTS` for the others) and go to state `nxt`."""
        m, fields = self.m, {**PASS_DEFAULTS, **fields}
        if self.by_site:
            assert not self._finished, "a launch after Steps.finish"
            self._sites.append(fields)
            if self.one_hot:
                # kept (but where the state selects it): each select a LUT output of its own, so that synthesis
                # does not fold the states' conditions into every field's choice
                by_state = self.registered and self._state is not None
                bit = Signal(name=f"pass_site_{len(self._sites) - 1}", attrs={} if by_state else {"keep": 1})
                self._site_bits.append(bit)
                self._site_states.append(self._state)
                m.d.comb += bit.eq(1)
            else:
                m.d.comb += self._site.eq(len(self._sites) - 1)
        else:
            for key, val in fields.items():
                m.d.comb += Value.cast(getattr(self.o_pass.payload, key)).eq(_value(val))
        if self.registered:
            go = self._site_bits[-1] if self.one_hot else Signal(name=f"pass_go_{len(self._goes)}", attrs={"keep": 1})
            if not self.one_hot:
                m.d.comb += go.eq(1)
            self._goes.append(go)
            self._go_states.append(self._state)
        else:
            m.d.comb += self._launch.eq(1)
        m.next = nxt

    def finish(self):
        """By site: drive the pass command's fields from the launch that runs (all 0 while none does)."""
        m, p = self.m, self._cmd
        assert self.by_site and not self._finished
        self._finished = True
        if self.registered and self._goes:
            # a fail takes back a launch of its own cycle, so of its own state: the fails in a state with no
            # launch are left out (all are kept while a launch's or the fail's state is not known)
            launching = set(self._go_states)
            backs = [b for b, st in zip(self._backs, self._back_states)
                     if None in launching or st is None or st in launching]
            taken_back = _or(backs) if backs else Const(0)
            m.d.comb += self._launch.eq(_or(self._goes) & ~taken_back)
        if self.one_hot and self.registered:
            per_state = {}
            for name in self._site_states[1:]:
                per_state[name] = per_state.get(name, 0) + 1
            self._site_bits = [bit if name is None or per_state[name] > 1 else self._in_state[name]
                               for bit, name in zip(self._site_bits, self._site_states)]
        for key, _ in p.shape():
            cases = [(k, f[key]) for k, f in enumerate(self._sites)
                     if k and key in f and not (isinstance(f[key], int) and f[key] == 0)]
            if cases and self.one_hot and self.registered:
                self._field_free(getattr(p, key), [(bit, f.get(key, 0)) for bit, f in
                                                   zip(self._site_bits[1:], self._sites[1:])])
            elif cases and self.one_hot:
                # the launches of one value share its select: the OR of their selects, then one AND per value
                groups = {}
                for k, val in cases:
                    groups.setdefault(_same(val), (val, []))[1].append(self._site_bits[k])
                m.d.comb += Value.cast(getattr(p, key)).eq(
                    _or([Mux(_or(bits), _value(val), 0) for val, bits in groups.values()]))
            elif cases:
                with m.Switch(self._site):
                    for k, val in cases:
                        with m.Case(k):
                            m.d.comb += Value.cast(getattr(p, key)).eq(_value(val))

    def _field_free(self, field, sel_vals):
        """One-hot and registered: drive `field` from the launches' (select, value) `sel_vals`, free while none
        runs (the register's payload is 0 then by the AND at the output): a constant field bit by bit, the OR
        of the selects of the launches that set it or the NOT of the OR of those that clear it, whichever is
        fewer; any other field the OR of its values gated by their selects (the launches of one value share
        its select)."""
        m, field = self.m, Value.cast(field)
        consts = [_const(val) for _, val in sel_vals]
        if all(c is not None for c in consts):
            for i in range(len(field)):
                ones = [sel for (sel, _), c in zip(sel_vals, consts) if (c >> i) & 1]
                zeros = [sel for (sel, _), c in zip(sel_vals, consts) if not (c >> i) & 1]
                m.d.comb += field[i].eq((_or(ones) if ones else 0) if len(ones) <= len(zeros) else ~_or(zeros))
            return
        groups = {}
        for sel, val in sel_vals:
            if _const(val) != 0:
                groups.setdefault(_same(val), (val, []))[1].append(sel)
        m.d.comb += field.eq(_or([Mux(_or(sels), _value(val), 0) for val, sels in groups.values()]))

    @contextmanager
    def state(self, name):
        """``with m.State(name)``, known to the launches in it (`one_hot`: their selects)."""
        with self.m.State(name):
            self._in_state[name] = bit = Signal(name=f"in_{name.lower()}")
            self.m.d.comb += bit.eq(1)
            self._state, outer = name, self._state
            try:
                yield
            finally:
                self._state = outer

    def done(self):
        return self.i_done.valid

    @property
    def result(self):
        """The last element of the completing pass's REG sink (read it in the cycle `done` is high)."""
        return self.i_done.payload.result

    def retire(self):
        self._end(ErrorCode.NONE, 0)
        self.m.next = self.idle

    def fail(self, code, at_engine=0):
        self._end(code, at_engine)
        if self.registered:
            back = Signal(name=f"pass_back_{len(self._backs)}", attrs={"keep": 1})
            self.m.d.comb += back.eq(1)
            self._backs.append(back)
            self._back_states.append(self._state)
        self.m.next = self.error

    def wait_pass(self, state, then):
        """State `state`: wait for the pass; a bus error ends the instruction, else ``then()``. With
        `bus_error_state`, a bus error goes there, which ends the instruction the cycle after (`bus_error`):
        the end and the return to `idle` then see one state for all the waits, not each of them."""
        m = self.m
        with self.state(state):
            with m.If(self.i_done.valid):
                with m.If(self.i_done.payload.err):
                    if self.bus_error_state is None:
                        self.fail(ErrorCode.BUS_ERROR)
                    else:
                        m.next = self.bus_error_state
                with m.Else():
                    then()

    def bus_error(self):
        """State `bus_error_state` (inside the FSM): end the instruction with BUS_ERROR."""
        with self.state(self.bus_error_state):
            self.fail(ErrorCode.BUS_ERROR)

    def pause(self, state, cycles, nxt):
        """`cycles` states from `state` on (``state``, ``state_1`` ...), then `nxt`."""
        names = [state] + [f"{state}_{i}" for i in range(1, cycles)] + [nxt]
        for here, there in zip(names, names[1:]):
            with self.state(here):
                self.m.next = there

    def go(self, name):
        def f():
            self.m.next = name
        return f

    def checks_registered(self, state, cases, otherwise):
        """State `state` registers each case's condition (one cycle); state ``state + "_C"`` then runs
        `checks` on the registered conditions, so that no cycle holds both the conditions' arithmetic and
        the choice among them. An action of None waits: back to `state`, whose conditions are taken again."""
        m = self.m
        flags = Signal(len(cases), name=f"{state.lower()}_flags")
        with self.state(state):
            m.d.sync += flags.eq(Cat(*[cond for cond, _ in cases]))
            m.next = state + "_C"
        with self.state(state + "_C"):
            self.checks([(flags[i], act or self.go(state)) for i, (_, act) in enumerate(cases)], otherwise)

    def checks_early(self, state, name, cases, otherwise):
        """`checks` on conditions on the context alone, in two states as `checks_registered` runs them: the
        conditions are registered every cycle (`context_flags` `name`: the instruction's from `state` on),
        `state` registers which of them is the first that holds (one-hot, with one flag more for none of
        them), and ``state + "_C"`` takes that action (`choose`): no cycle holds the conditions' arithmetic,
        their order, or the order's choice with what the action drives."""
        m = self.m
        flags = context_flags(m, name, [cond for cond, _ in cases])
        # the order by groups of G: each group's OR a LUT of its own (kept), so that a flag's "none before" is
        # one LUT on the earlier groups' ORs and its own group's earlier flags, not a chain of ORs
        G = 5
        any_g = []
        for j in range(0, len(flags), G):
            g = Signal(name=f"{name}_any{j // G}", attrs={"keep": 1})
            m.d.comb += g.eq(Cat(*flags[j:j + G]).any())
            any_g.append(g)
        first = Signal(len(cases) + 1, name=f"{name}_first")
        m.d.sync += first.eq(Cat(*[f & ~Cat(*any_g[:k // G], *flags[k - k % G:k]).any() for k, f in enumerate(flags)],
                                 ~Cat(*any_g).any()))
        with self.state(state):
            self.m.next = state + "_C"
        with self.state(state + "_C"):
            self.choose([first[k] for k in range(len(cases) + 1)], [act for _, act in cases] + [otherwise])

    def choose(self, flags, actions):
        """One ``If`` per action on its flag, `flags` one-hot (`context_flags` with ``first``): each action's
        condition is its flag alone, no chain of the ones before it."""
        for flag, act in zip(flags, actions, strict=True):
            with self.m.If(flag):
                act()

    def checks(self, cases, otherwise):
        """``If``/``Elif`` over `cases` (condition, action) in order, then ``Else: otherwise()``."""
        m = self.m
        for k, (cond, act) in enumerate(cases):
            with (m.Elif if k else m.If)(cond):
                act()
        with m.Else():
            otherwise()


def _value(val):
    return Value.cast(val) if isinstance(val, enum.Enum) else val


def _const(val):
    """The integer of a constant value (an int, an enum member), else None."""
    if isinstance(val, int):
        return val
    if isinstance(val, enum.Enum):
        return Value.cast(val).value
    return None


def _same(val):
    """A key equal for the values of the same expression on the same signals."""
    if isinstance(val, int):
        return ("int", val)
    v = Value.cast(val)
    return repr(v), tuple(sorted(id(sig) for sig in v._rhs_signals()))


def _or(terms):
    """The OR of `terms`, as a balanced tree."""
    while len(terms) > 1:
        terms = [terms[k] | terms[k + 1] if k + 1 < len(terms) else terms[k] for k in range(0, len(terms), 2)]
    return terms[0]


def context_flags(m, name, conds, first=False):
    """`conds`, conditions on the context, registered every cycle (one cycle): the word and the descriptor are
    the instruction's from the cycle the controller starts the sequencer on (`Sequencer`), so from its first
    state on the flags are the instruction's, and no cycle holds both their arithmetic and the choice among
    the checks.

    With `first`, flag k is condition k and none before it, and one more flag follows: none of them (one
    flag of the result is high), for `Steps.choose`."""
    if first:
        conds = [c & ~Cat(*conds[:k]).any() if k else c for k, c in enumerate(conds)] + [~Cat(*conds).any()]
    flags = Signal(len(conds), name=name)
    m.d.sync += flags.eq(Cat(*conds))
    return [flags[i] for i in range(len(conds))]


PRODUCT_LATENCY = 4


def product(m, a, b, width, name):
    """``(a · b) mod 2**width`` of unsigned `a` and `b`, registered: the operands of cycle x give the result from
    cycle x + `PRODUCT_LATENCY` on (it follows them while they change). Each partial product (26 × 17 bits) is
    a `hdl.dsp.DspMacc` with all its registers (Yosys packs none into a multiply of the RTL: a product from
    registers into a register is a DSP48E2 with none, 3.15 ns in `hdl.timing`), then one register their sum."""
    a, b = Value.cast(a), Value.cast(b)
    if len(b) > len(a):
        a, b = b, a
    wa, wb = MUL_A_BITS - 1, MUL_B_BITS - 1
    parts = []
    for i in range(0, len(a), wa):
        for j in range(0, len(b), wb):
            if i + j < width:
                m.submodules[f"{name}_{i}_{j}"] = mac = DspMacc(MUL_A_BITS, MUL_B_BITS)
                m.d.comb += [mac.i_a.eq(a[i:i + wa]), mac.i_b.eq(b[j:j + wb]), mac.i_restart.eq(1)]
                parts.append(mac.o_p[:width - i - j] << (i + j))
    res = Signal(width, name=name)
    m.d.sync += res.eq(sum(parts)[:width])
    return res


def recode(fsm, encoding="auto"):
    """Mark `fsm`'s state register (after its ``with m.FSM`` block) for re-encoding by synthesis: Yosys takes
    ``auto`` as one-hot below 32 states (a state's test one flip-flop, not a decode of the binary number ahead
    of every condition), Vivado extracts FSMs itself either way. The re-encoded register starts from the
    reset (the system's synchronous reset), not from its initial value."""
    fsm._data["signal"].attrs["fsm_encoding"] = encoding


def end_to(m, o_end):
    """An `end` callable for `Steps` driving the sequencer's ``o_end``."""
    def end(code, at_engine):
        m.d.comb += [o_end.valid.eq(1), o_end.payload.code.eq(code), o_end.payload.at_engine.eq(at_engine)]
    return end


class EndSites:
    """An `end` callable for `Steps` driving the sequencer's ``o_end`` by site: each call a select of its own
    (high while it runs), the valid the OR of the selects and each field the OR of its values gated by their
    selects (the sites of one value share its select), driven in `finish` (after the FSM). No chain through the
    FSM's statements in their order: the ends of one cycle are exclusive (the states' checks are ``If``/``Elif``
    chains or one-hot choices), so the OR is the end that runs."""

    def __init__(self, m, o_end):
        self._m, self._o_end, self._sites = m, o_end, []

    def __call__(self, code, at_engine):
        bit = Signal(name=f"end_site_{len(self._sites)}")
        self._m.d.comb += bit.eq(1)
        self._sites.append((bit, {"code": code, "at_engine": at_engine}))

    def finish(self):
        m, o_end = self._m, self._o_end
        m.d.comb += o_end.valid.eq(_or([bit for bit, _ in self._sites]))
        for key in ("code", "at_engine"):
            groups = {}
            for bit, vals in self._sites:
                if _const(vals[key]) != 0:
                    groups.setdefault(_same(vals[key]), (vals[key], []))[1].append(bit)
            if groups:
                m.d.comb += Value.cast(getattr(o_end.payload, key)).eq(
                    _or([Mux(_or(bits), _value(val), 0) for val, bits in groups.values()]))



def elem(word_addr):
    """The element address of an L2 word address (4 binary32 elements per 16-byte word)."""
    return Cat(Const(0, 2), word_addr)


def l2_elements(hw: HardwareConfig) -> int:
    return hw.l2_bytes // 4


def in_l2(hw: HardwareConfig, e, n):
    """The element range [e, e + n) lies inside L2 (a length of more bits than the L2's element count has is
    outside by those bits alone: the sum and its compare are as wide as L2 only)."""
    top, n = l2_elements(hw), Value.cast(n)
    if len(n) > top.bit_length():
        return (n[top.bit_length():] == 0) & ((e + n[:top.bit_length()]) <= top)
    return (e + n) <= top


def geometry(hw: HardwareConfig):
    """(EA, NB, first scratch element, scratch elements) of `hw`'s L2."""
    ea, nb, _ = l2_geometry(hw)
    return ea, nb, (hw.l2_bytes - hw.l2_scratch_bytes) // 4, hw.l2_scratch_bytes // 4
