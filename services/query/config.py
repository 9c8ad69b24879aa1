"""The deployment's defaults the query pipeline reads: the settings of the same names, defaults included."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ontofabric.shared.settings import Settings

from .calibration import SIGNALS, Calibration, Platt


def _default(name: str) -> Any:
    return Settings.model_fields[name].default


@dataclass(frozen=True)
class PipelineConfig:
    """Every field is the setting of the same name (``ontofabric settings``), with its default; a request option
    that is left out takes the value here."""

    retriever_top_k: int = _default("retriever_top_k")
    fusion_method: str = _default("fusion_method")
    rrf_k: int = _default("rrf_k")
    fusion_dense_weight: float = _default("fusion_dense_weight")
    fusion_dense_trusted_cosine: float = _default("fusion_dense_trusted_cosine")
    fusion_dense_unrelated_cosine: float = _default("fusion_dense_unrelated_cosine")
    fusion_dense_cosine_model: str = _default("fusion_dense_cosine_model")
    early_exit_saturation: float = _default("early_exit_saturation")
    reranker_timeout_ms: int = _default("reranker_timeout_ms")
    reranker_depth: int = _default("reranker_depth")
    reranker_cost_per_call_usd: float = _default("reranker_cost_per_call_usd")
    reranker_cost_per_document_usd: float = _default("reranker_cost_per_document_usd")
    late_interaction_weight: float = _default("late_interaction_weight")
    late_interaction_depth: int = _default("late_interaction_depth")
    late_interaction_max_query_tokens: int = _default("late_interaction_max_query_tokens")
    second_opinion_weight: float = _default("second_opinion_weight")
    second_opinion_depth: int = _default("second_opinion_depth")
    expansion_max_types: int = _default("expansion_max_types")
    collapse_nested: bool = _default("collapse_nested")
    exact_symbols: bool = _default("exact_symbols")
    calibrated_scores: bool = _default("calibrated_scores")
    calibration_embedding_model: str = _default("calibration_embedding_model")
    calibration_dense: tuple[float, ...] = _default("calibration_dense")
    calibration_keyword: tuple[float, ...] = _default("calibration_keyword")
    calibration_hybrid: tuple[float, ...] = _default("calibration_hybrid")

    def calibration(self) -> Calibration:
        return Calibration(
            Platt.of(self.calibration_dense, SIGNALS["dense"]),
            Platt.of(self.calibration_keyword, SIGNALS["keyword"]),
            Platt.of(self.calibration_hybrid, SIGNALS["hybrid"]),
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> PipelineConfig:
        return cls(**{field.name: getattr(settings, field.name) for field in fields(cls)})
