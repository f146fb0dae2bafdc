"""The model's size presets (``build_model(arch, size)``, ``hydra-train run --model_size``), the
earlier layouts kept measurable, and the seed table's parameter counts the presets are held to.
HydraConfig (config.py) gives every field's meaning."""

from __future__ import annotations

from typing import Any

#: Size presets. Parameter counts at vocab 32000 land within 10% of the seed table (debug ~33M,
#: 100M ~101M, 250M ~203M, 500M ~437M, 1B ~974M against 104M, 198M, 426M and 973M;
#: tests/hydra_model/test_config.py checks it). Head counts are chosen per size so that the latent
#: head size dim / (compression_factor · n_heads) is 64 and n_heads is divisible by n_kv_heads; the
#: MLP ratio is what lands the count (tiny and debug have few blocks, so their MLPs are wide: debug
#: keeps the seed's 33M with two blocks, hence its 10×).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        dim=256,
        n_mor_blocks=2,
        recursions_per_block=2,
        n_heads=2,
        n_kv_heads=1,
        compression_factor=2.0,
        mlp_ratio=4.0,
        max_seq_len=1024,
    ),
    "debug": dict(
        dim=512,
        n_mor_blocks=2,
        recursions_per_block=2,
        n_heads=4,
        n_kv_heads=2,
        compression_factor=2.0,
        mlp_ratio=10.0,
        max_seq_len=2048,
    ),
    # the preset the race is run on (hydra-diag/BENCHMARKS.md): twelve unique blocks with the
    # dense GPT's widths and CCGQA at its head layout (12 latent query heads, 4 kv heads of 64:
    # the race's gpt-ccgqa entrant beat the plain GPT at equal time with it), one recursion (MoR
    # off: at a fixed size a second recursion adds compute per token, and the race's MoR rows
    # lost), MoD at 12.5% on every other block as in the MoD paper: ~71% of the GPT's training
    # FLOPs per token. Earlier presets: HYDRA_V2_100M (the 2026-11-23 race: 12 × 2, C = 3) and
    # HYDRA_V1_100M (8 × 4, MoD 0.75 on blocks 1–6).
    "100M": dict(
        dim=768,
        n_mor_blocks=12,
        recursions_per_block=1,
        n_heads=12,
        n_kv_heads=4,
        compression_factor=1.0,
        mlp_ratio=8 / 3,
        mod_capacity=0.125,
        mod_block_stride=2,
        max_seq_len=2048,
    ),
    # 250M, 500M and 1B: the 100M preset's layout at the dense GPT presets' widths (gpt_config.py:
    # the same dim, depth, head counts and SwiGLU width, CCGQA uncompressed, one recursion, MoD
    # 12.5% on every other block). The 100M races chose it; at 500M one 120 s race checked it
    # (hydra-diag/BENCHMARKS.md); 250M and 1B carry it unraced. The seed's layouts they replace
    # are PRE_RACE_PRESETS below.
    "250M": dict(
        dim=1024,
        n_mor_blocks=16,
        recursions_per_block=1,
        n_heads=16,
        n_kv_heads=4,
        compression_factor=1.0,
        mlp_ratio=2.5,
        mod_capacity=0.125,
        mod_block_stride=2,
        max_seq_len=2048,
    ),
    "500M": dict(
        dim=1536,
        n_mor_blocks=16,
        recursions_per_block=1,
        n_heads=24,
        n_kv_heads=8,
        compression_factor=1.0,
        mlp_ratio=2.5,
        mod_capacity=0.125,
        mod_block_stride=2,
        max_seq_len=2048,
    ),
    "1B": dict(
        dim=2048,
        n_mor_blocks=20,
        recursions_per_block=1,
        n_heads=32,
        n_kv_heads=8,
        compression_factor=1.0,
        mlp_ratio=2.75,
        mod_capacity=0.125,
        mod_block_stride=2,
        max_seq_len=2048,
    ),
}

#: The 100M preset of the 2026-11-23 race: twelve blocks × two recursions (the second for half the
#: tokens), CCGQA compressed 3× (4 latent query heads), MoD 12.5% on every other block (the race's
#: ``hydra-v2`` configuration keeps it measurable).
HYDRA_V2_100M: dict[str, Any] = dict(
    dim=768,
    n_mor_blocks=12,
    recursions_per_block=2,
    mor_capacities=(1.0, 0.5),
    n_heads=4,
    n_kv_heads=2,
    compression_factor=3.0,
    mlp_ratio=3.25,
    mod_capacity=0.125,
    mod_block_stride=2,
    max_seq_len=2048,
)

#: The 100M preset before the race: 8 blocks × 4 recursions, MoD 0.75 on blocks 1–6 (the race's
#: ``hydra-v1`` configuration keeps it measurable).
HYDRA_V1_100M: dict[str, Any] = dict(
    dim=768,
    n_mor_blocks=8,
    recursions_per_block=4,
    n_heads=4,
    n_kv_heads=2,
    compression_factor=3.0,
    mlp_ratio=16 / 3,
    mor_capacities=None,
    mod_capacity=0.75,
    mod_block_stride=1,
    max_seq_len=2048,
)

#: The seed's layouts of 250M, 500M and 1B (four recursions per block, compressed CCGQA, MoD 0.75
#: on every inner block), the presets until 2026-11-26: kept so that they stay measurable, e.g.
#: ``HydraConfig(**PRE_RACE_PRESETS["500M"])``.
PRE_RACE_PRESETS: dict[str, dict[str, Any]] = {
    "250M": dict(
        dim=1024,
        n_mor_blocks=10,
        recursions_per_block=4,
        n_heads=4,
        n_kv_heads=2,
        compression_factor=4.0,
        mlp_ratio=5.0,
        mod_capacity=0.75,
        mod_block_stride=1,
        max_seq_len=2048,
    ),
    "500M": dict(
        dim=1280,
        n_mor_blocks=16,
        recursions_per_block=4,
        n_heads=8,
        n_kv_heads=2,
        compression_factor=2.5,
        mlp_ratio=4.6,
        mod_capacity=0.75,
        mod_block_stride=1,
        max_seq_len=2048,
    ),
    "1B": dict(
        dim=1792,
        n_mor_blocks=20,
        recursions_per_block=4,
        n_heads=8,
        n_kv_heads=2,
        compression_factor=3.5,
        mlp_ratio=4.5,
        mod_capacity=0.75,
        mod_block_stride=1,
        max_seq_len=2048,
    ),
}

#: The seed table's parameter counts (vocab 32000), which the presets are held to.
SEED_PARAM_COUNTS: dict[str, float] = {
    "debug": 33e6,
    "100M": 104e6,
    "250M": 198e6,
    "500M": 426e6,
    "1B": 973e6,
}
