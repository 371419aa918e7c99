"""Single machine instructions for the numba kernels (llvmlite intrinsics): bit casts both
ways, 16-wide vector compares, trailing-zero and population counts, unaligned 64-bit loads
and stores, an 8-wide table row stored with an offset added, loads, stores and prefetches
through raw addresses (one kernel call updates many tensors), and an atomic add and load
for threads that share out work. Numba's own integer typing widens and branches where
these do not.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16  # elements per vector compare: two AVX2 registers of eight int32


def _call(builder, name: str, ret, args: list, values: list):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)
    return builder.call(fn, values)


@intrinsic
def f32_bits(typingctx, x):
    """The IEEE bit pattern of a float32 as int32 (a register move, no memory)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, x):
    """The float32 whose IEEE bit pattern is the int32 x (the inverse of f32_bits; wider
    integers are truncated to 32 bits)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def ge_mask16(typingctx, arr, i, t):
    """Bit j set where key(arr[i + j]) >= t, for j < 16: the |x| bits of an fp32 array,
    or the values of an int32 one (two vector compares and a movemask)."""
    if not (isinstance(arr, types.Array) and arr.dtype in (types.float32, types.int32) and arr.ndim == 1):
        return None
    magnitude = arr.dtype == types.float32

    def codegen(context, builder, signature, args):
        a, ix, tv = args
        vty = ir.VectorType(ir.IntType(32), LANES)
        data = context.make_array(signature.args[0])(context, builder, a).data
        v = builder.load(builder.bitcast(builder.gep(data, [ix]), vty.as_pointer()), align=4)
        if magnitude:
            v = builder.and_(v, ir.Constant(vty, [0x7FFFFFFF] * LANES))
        one = builder.insert_element(ir.Constant(vty, ir.Undefined), tv, ir.Constant(ir.IntType(32), 0))
        splat = builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined),
                                       ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))
        mask = builder.bitcast(builder.icmp_signed(">=", v, splat), ir.IntType(LANES))
        return builder.zext(mask, ir.IntType(64))

    return types.uint64(arr, i, types.int32), codegen


@intrinsic
def fetch_add(typingctx, arr, i, v):
    """Atomically add v to arr[i] (int64) and return the value before (acquire and
    release order): threads share out work and say when they are done through it."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", builder.gep(data, [args[1]]), args[2], "acq_rel")

    return types.int64(arr, types.intp, types.int64), codegen


@intrinsic
def load_acquire(typingctx, arr, i):
    """arr[i] of an int64 array as an atomic load with acquire order: a spin loop sees
    another thread's stores, and what it wrote before them."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.load_atomic(builder.gep(data, [args[1]]), "acquire", 8)

    return types.int64(arr, types.intp), codegen


@intrinsic
def ctz(typingctx, x):
    """Trailing zero bits of a nonzero uint64 (one tzcnt)."""
    if x != types.uint64:
        return None

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        return _call(builder, "llvm.cttz.i64", i64, [i64, ir.IntType(1)], [args[0], ir.Constant(ir.IntType(1), 1)])

    return types.uint64(types.uint64), codegen


@intrinsic
def popcount(typingctx, x):
    """Set bits of a uint64 (one popcnt)."""
    if x != types.uint64:
        return None

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        return _call(builder, "llvm.ctpop.i64", i64, [i64], [args[0]])

    return types.uint64(types.uint64), codegen


@intrinsic
def load_u64(typingctx, buf, i):
    """The 8 bytes buf[i:i+8] as a little-endian uint64 (one unaligned load; the caller
    keeps i + 8 <= len(buf))."""
    if not (isinstance(buf, types.Array) and buf.dtype == types.uint8 and buf.ndim == 1):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        return builder.load(ptr, align=1)

    return types.uint64(buf, i), codegen


@intrinsic
def store_u64(typingctx, buf, i, v):
    """buf[i:i+8] = the 8 little-endian bytes of v (one unaligned store; the caller keeps
    i + 8 <= len(buf))."""
    if not (isinstance(buf, types.Array) and buf.dtype == types.uint8 and buf.ndim == 1 and v == types.uint64):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        builder.store(args[2], ptr, align=1)
        return context.get_dummy_value()

    return types.void(buf, i, v), codegen


@intrinsic
def put8_plus(typingctx, dst, o, table, row, add):
    """dst[o:o+8] = table[8*row : 8*row+8] + add, for int32 arrays (one vector load, add
    and unaligned store; the caller keeps o + 8 <= len(dst))."""
    if not (isinstance(dst, types.Array) and isinstance(table, types.Array)
            and dst.dtype == types.int32 and table.dtype == types.int32):
        return None

    def codegen(context, builder, signature, args):
        d, ov, tb, rv, av = args
        i32 = ir.IntType(32)
        vty = ir.VectorType(i32, 8)
        dptr = context.make_array(signature.args[0])(context, builder, d).data
        tptr = context.make_array(signature.args[2])(context, builder, tb).data
        start = builder.mul(context.cast(builder, rv, signature.args[3], types.int64), ir.Constant(ir.IntType(64), 8))
        v = builder.load(builder.bitcast(builder.gep(tptr, [start]), vty.as_pointer()), align=4)
        one = builder.insert_element(ir.Constant(vty, ir.Undefined),
                                     builder.trunc(context.cast(builder, av, signature.args[4], types.int64), i32),
                                     ir.Constant(i32, 0))
        splat = builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined), ir.Constant(vty, [0] * 8))
        builder.store(builder.add(v, splat), builder.bitcast(builder.gep(dptr, [ov]), vty.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(dst, o, table, row, add), codegen


def _f32_ptr(builder, addr, i):
    base = builder.inttoptr(addr, ir.FloatType().as_pointer())
    return builder.gep(base, [i])


@intrinsic
def add_f32_at(typingctx, addr, i, x):
    """``p[i] = p[i] + x`` for the fp32 array whose data starts at address addr; returns
    the value it replaced."""
    if not (isinstance(addr, types.Integer) and isinstance(i, types.Integer) and x == types.float32):
        return None

    def codegen(context, builder, signature, args):
        ptr = _f32_ptr(builder, args[0], args[1])
        old = builder.load(ptr)
        builder.store(builder.fadd(old, args[2]), ptr)
        return old

    return types.float32(addr, i, x), codegen


def _load(builder, ty, addr, i):
    return builder.load(builder.gep(builder.inttoptr(addr, ty.as_pointer()), [i]))


def _index_args(addr, i) -> bool:
    return isinstance(addr, types.Integer) and isinstance(i, types.Integer)


@intrinsic
def load_f32_at(typingctx, addr, i):
    """Element i of the fp32 array whose data starts at address addr."""
    if not _index_args(addr, i):
        return None

    def codegen(context, builder, signature, args):
        return _load(builder, ir.FloatType(), args[0], args[1])

    return types.float32(addr, i), codegen


@intrinsic
def load_u16_at(typingctx, addr, i):
    """Element i of the uint16 array whose data starts at address addr."""
    if not _index_args(addr, i):
        return None

    def codegen(context, builder, signature, args):
        return _load(builder, ir.IntType(16), args[0], args[1])

    return types.uint16(addr, i), codegen


@intrinsic
def load_u8_at(typingctx, addr, i):
    """Byte i of the uint8 array whose data starts at address addr."""
    if not _index_args(addr, i):
        return None

    def codegen(context, builder, signature, args):
        return _load(builder, ir.IntType(8), args[0], args[1])

    return types.uint8(addr, i), codegen


@intrinsic
def store_f32_at(typingctx, addr, i, x):
    """``p[i] = x`` for the fp32 array whose data starts at address addr."""
    if not (isinstance(addr, types.Integer) and isinstance(i, types.Integer) and x == types.float32):
        return None

    def codegen(context, builder, signature, args):
        builder.store(args[2], _f32_ptr(builder, args[0], args[1]))
        return context.get_dummy_value()

    return types.void(addr, i, x), codegen


@intrinsic
def prefetch_f32_at(typingctx, addr, i):
    """Ask for the cache line of element i of the fp32 array at address addr, ahead of
    a write (a hint: never faults)."""
    if not (isinstance(addr, types.Integer) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        ptr = builder.bitcast(_f32_ptr(builder, args[0], args[1]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        _call(builder, "llvm.prefetch.p0i8", ir.VoidType(), [ptr.type, i32, i32, i32],
              [ptr, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(addr, i), codegen
