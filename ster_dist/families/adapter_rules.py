"""Families seeds/000 refuses adapters on (or some targets on), with the reason: tables that adapter
attach, merge and training all check, on the config alone, before any adapter or weight is read.
(Most of these families have no FamilySpec yet; when they gain one the reason can move into it.)"""

_STATE_SPACE = "its state-space layers have no attention or feed-forward projection"
_HYPER = "its hyper-connections run every sublayer over several residual streams"
_NO_ADAPTER = "seeds/000 takes no adapter on this family"

REFUSED_FAMILIES = {
    **{
        name: _STATE_SPACE
        for name in (
            "mamba",
            "falcon_mamba",
            "mamba2",
            "bamba",
            "jamba",
            "nemotron_h",
            "falcon_h1",
            "zamba2",
            "lfm2",
            "lfm2_moe",
        )
    },
    "qwen3_next": "its linear-attention layers have no attention projection to adapt",
    "kimi_linear": "its linear-attention layers have no attention projection to adapt",
    "nanbeige": "it is a looped model: one adapter would correct every pass of its layer",
    "iquestloopcoder": "it is a looped model: one adapter would correct every pass of its layer",
    "nemotron-nas": "no projection has one shape on every layer",
    "deepseek_v4": _HYPER,
    "glm5_next_text": _HYPER,
    "hrm_text": "one stored layer runs on several passes",
    "inkling_text": _NO_ADAPTER,
    "minimax": _NO_ADAPTER,
    "minimax_text_01": _NO_ADAPTER,
    "longcat_flash": _NO_ADAPTER,
    "longcat_flash_ngram": _NO_ADAPTER,
}

ATTENTION = ("query", "key", "value", "output")
# family -> (the targets seeds/000 refuses on it, why)
TARGETS_REFUSED = {
    "gemma4_text": (
        ATTENTION,
        "full-attention heads are wider than sliding ones; train on gate,up,down",
    ),
    "gemma4_unified_text": (
        ATTENTION,
        "full-attention heads are wider than sliding ones; train on gate,up,down",
    ),
    "dots3_note": (ATTENTION, "its two kinds of attention layer differ in shape"),
    "mimo_v2_flash": (ATTENTION, "its two kinds of attention differ in key-value heads"),
    "mimo_v2": (ATTENTION, "its two kinds of attention differ in key-value heads"),
    "step3_text": (("query",), "wq reads the bottleneck rather than the hidden state"),
}
