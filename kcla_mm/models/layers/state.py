"""States carried between the blocks of a backbone by layer attention."""
from typing import List, NamedTuple, Optional

from torch import Tensor

from kcla_mm.ops.kcla_branch import StateTape


class KCLAState(NamedTuple):
    """KCLA's recurrent state after a layer (docs/method.md §2, step 4).

    Attributes:
        u (Tensor): U = sum_s w_s * X^s, (B, C, H, W), float32.
        z (Tensor): Z = sum_s w_s, (B, G), float32, one entry per head.
        tape (StateTape, optional): set when the layer that produced ``u``
            did not save it for backward; the next layer hands ``u`` back
            (inverting its own update on the fused training path, else
            keeping ``u``).
    """
    u: Tensor
    z: Tensor
    tape: Optional[StateTape] = None

    @property
    def num_heads(self) -> int:
        return self.z.shape[1]

    def aggregate(self, eps: float = 0.0) -> Tensor:
        """A = U / (Z + eps), (B, C, H, W)."""
        b, c, h, w = self.u.shape
        g = self.z.shape[1]
        a = self.u.view(b, g, c // g, h, w) / (self.z.view(b, g, 1, 1, 1) + eps)
        return a.view(b, c, h, w)


class LayerAttentionCache(NamedTuple):
    """The cache of standard (quadratic) layer attention within a stage.

    Attributes:
        keys (list[Tensor]): K^s of every earlier layer, each (B, C).
        values (list[Tensor]): V^s = DWConv(X^s), each (B, C, H, W).
    """
    keys: List[Tensor]
    values: List[Tensor]

