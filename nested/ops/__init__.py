"""Functional memory ops: inputs (B, T, H, D), value-by-key state (B, H, d_v, d_k), returning (o, final_state)."""

# Type I: linear associative memories (chunkwise-parallel, exact).
from nested.ops.delta import delta_rule, gated_delta_rule, linear_attention
from nested.ops.falcon import falcon
from nested.ops.gdn2 import gdn2
from nested.ops.ttt_linear import ttt_linear

# Type II: nonlinear (MLP) neural memories.
from nested.ops.atlas import AtlasState, atlas, atlas_state, newton_schulz, polynomial_features
from nested.ops.mlp_memory import MemoryForm, init_mlp_memory, mlp_apply
from nested.ops.titans import TitansState, titans, titans_state
from nested.ops.ttt_mlp import ttt_mlp
