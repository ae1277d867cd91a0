"""numpy arrays <-> moe.v1.Tensor (dense, row-major, little-endian bytes), and BF16 rounding.

BF16 conversion matches the C++ side (kernels/formats.cc FloatToBf16): round to nearest even on the
upper 16 bits of the fp32 pattern; a NaN keeps its sign and gets the quiet bit so that truncation
cannot turn it into an infinity.
"""

import numpy as np

from moe_serve_client import pb

_NUMPY_OF = {
    pb.tensor_pb2.F32: np.dtype("<f4"),
    pb.tensor_pb2.BF16: np.dtype("<u2"),  # raw bits
    pb.tensor_pb2.U8: np.dtype("u1"),
    pb.tensor_pb2.I32: np.dtype("<i4"),
    pb.tensor_pb2.I64: np.dtype("<i8"),
    pb.tensor_pb2.E4M3: np.dtype("u1"),
    pb.tensor_pb2.BOOL: np.dtype("u1"),
}


def to_tensor(array, dtype):
    """A moe.v1.Tensor holding `array` converted to the wire dtype `dtype` (BF16: raw bits)."""
    array = np.ascontiguousarray(array, dtype=_NUMPY_OF[dtype])
    return pb.tensor_pb2.Tensor(dtype=dtype, shape=list(array.shape), data=array.tobytes())


def from_tensor(tensor):
    """The numpy array of a moe.v1.Tensor (BF16 widened to float32). ValueError if the byte count
    does not match the shape."""
    if tensor.dtype not in _NUMPY_OF:
        raise ValueError("unsupported tensor dtype %d" % tensor.dtype)
    dtype = _NUMPY_OF[tensor.dtype]
    shape = tuple(tensor.shape)
    if len(tensor.data) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise ValueError("tensor of shape %s carries %d bytes" % (shape, len(tensor.data)))
    array = np.frombuffer(tensor.data, dtype=dtype).reshape(shape)
    if tensor.dtype == pb.tensor_pb2.BF16:
        return bf16_bits_to_float(array)
    return array


def float_to_bf16_bits(x):
    """float32 array -> uint16 BF16 bit patterns, round to nearest even."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return np.where(np.isnan(x), quiet_nan, rounded)


def bf16_bits_to_float(bits):
    """uint16 BF16 bit patterns -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)
