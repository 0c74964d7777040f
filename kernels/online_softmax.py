"""The flash-attention update both attention kernels run per key tile."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(acc, m_i, l_i, qk, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores (qk, log2-scaled and masked with -inf) and its values into the
    running max m_i, sum l_i and unnormalised output acc. The caller guarantees each row has
    seen a finite score by its first tile, so masked scores give exp2(-inf) = 0, never NaN."""
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
