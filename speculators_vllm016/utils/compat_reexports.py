"""The only names a module of this package passes on from another of its modules.

Each entry is a path where 0.3.0 had the name, kept so that 0.3.0's imports (`from
speculators.models import Eagle3DraftModel`) keep working. Everywhere else a name has one home:
the package's modules, and its tests, import it from the module that defines it.
`tests/utils/test_compat_reexports.py` fails on a re-export missing here. Imports nothing.
"""

from __future__ import annotations

__all__ = ["COMPAT_REEXPORTS"]

# module -> names it takes from another module of the package; 0.3.0 had each at this path.
COMPAT_REEXPORTS: dict[str, frozenset[str]] = {
    "speculators_vllm016": frozenset(
        {
            "SpeculatorModel",
            "SpeculatorModelConfig",
            "SpeculatorsConfig",
            "TokenProposalConfig",
            "VerifierConfig",
            "reload_and_populate_configs",
            "reload_and_populate_models",
            "__version__",  # the package's version, where every package has it
        }
    ),
    "speculators_vllm016.convert": frozenset({"convert_model"}),
    "speculators_vllm016.convert.eagle": frozenset({"EagleConverter"}),
    "speculators_vllm016.convert.eagle.utils": frozenset({"find_vocab_size"}),
    "speculators_vllm016.data_generation": frozenset({"VllmHiddenStatesGenerator"}),
    "speculators_vllm016.models": frozenset(
        {
            "Eagle3DraftModel",
            "Eagle3SpeculatorConfig",
            "EagleSpeculator",
            "EagleSpeculatorConfig",
            "IndependentSpeculatorConfig",
            "MLPSpeculatorConfig",
        }
    ),
    "speculators_vllm016.models.eagle3": frozenset({"Eagle3DraftModel", "Eagle3SpeculatorConfig"}),
    "speculators_vllm016.models.eagle3.core": frozenset(
        {"align_for_step", "compute_accuracy", "compute_metrics", "loss_function"}
    ),
    "speculators_vllm016.proposals": frozenset({"GreedyTokenProposalConfig"}),
    "speculators_vllm016.train.checkpointer": frozenset(
        {"convert_float_dtype", "load_safetensors_state_dict"}
    ),
    "speculators_vllm016.train.trainer": frozenset({"TrainerConfig"}),
    "speculators_vllm016.utils": frozenset(
        {
            "AutoImporterMixin",
            "ClassRegistryMixin",
            "PydanticClassRegistryMixin",
            "ReloadableBaseModel",
        }
    ),
}
