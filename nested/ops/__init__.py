"""Functional memory ops, pure JAX: inputs ``(B, T, H, D)``, returning ``(o, final_state)``.

Type I (linear associative memories, value-by-key state ``(B, H, d_v, d_k)``, chunkwise
parallel and exact for every chunk size): ``linear_attention``, ``delta_rule``,
``gated_delta_rule``, ``falcon``, ``gdn2``, and mini-batch ``ttt_linear``.
Type II (MLP memories, parameters as a tuple of layers with leading ``(B, H)``): ``ttt_mlp``,
``titans``, ``atlas``. ``stream`` runs a stream of the mini-batch ops cut anywhere.
Every op but ``atlas`` (and Falcon-3's window) also runs packed documents: ``starts (B, T)``
restarts the memory where a document starts (:mod:`nested.ops.documents`).
"""

from nested.ops.atlas import AtlasState, atlas, atlas_state, newton_schulz, polynomial_features
from nested.ops.delta import delta_rule, gated_delta_rule, linear_attention
from nested.ops.falcon import falcon
from nested.ops.gdn2 import gdn2
from nested.ops.mlp_memory import MemoryForm, init_mlp_memory, mlp_apply
from nested.ops.stream import stream
from nested.ops.titans import TitansState, titans, titans_state
from nested.ops.ttt_linear import ttt_linear
from nested.ops.ttt_mlp import ttt_mlp

__all__ = [
    "AtlasState",
    "MemoryForm",
    "TitansState",
    "atlas",
    "atlas_state",
    "delta_rule",
    "falcon",
    "gated_delta_rule",
    "gdn2",
    "init_mlp_memory",
    "linear_attention",
    "mlp_apply",
    "newton_schulz",
    "polynomial_features",
    "stream",
    "titans",
    "titans_state",
    "ttt_linear",
    "ttt_mlp",
]
