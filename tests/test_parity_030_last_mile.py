"""Compatibility with code written against speculators 0.3.0 (issue 30).

Such code matches on 0.3.0's error sentences (`pytest.raises(match=...)`, `"..." in str(e)`),
patches names in 0.3.0's modules and relies on a few of its behaviours. Our messages keep
0.3.0's sentence first and add ours after it; these tests pin both halves.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal
from unittest import mock

import pytest
from pydantic import BaseModel
from torch import nn

from speculators_vllm016.config import (
    SpeculatorModelConfig,
    SpeculatorsConfig,
    TokenProposalConfig,
    VerifierConfig,
)
from speculators_vllm016.model import SpeculatorModel
from speculators_vllm016.proposals import GreedyTokenProposalConfig
from speculators_vllm016.utils import PydanticClassRegistryMixin
from speculators_vllm016.utils.auto_importer import AutoImporterMixin
from speculators_vllm016.utils.registry import ClassRegistryMixin

# ------------------------------------------------------------------ registries: wording


class _Registry(ClassRegistryMixin):
    pass


class _AutoRegistry(ClassRegistryMixin):
    registry_auto_discovery: ClassVar[bool] = False


def test_registry_errors_start_with_0_3_0_sentences():
    with pytest.raises(ValueError, match=r"name must be a string or None\. .*got 5"):
        _Registry.register(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be used as a class decorator.*not a class"):
        _Registry.register_decorator("not a class")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be used as a class decorator.*strings, got 7"):
        _Registry.register_decorator(type("X", (), {}), name=7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be called after registering classes.*_Registry"):
        _Registry.registered_classes()
    with pytest.raises(ValueError, match="registry_auto_discovery is set to False.*_AutoRegistry"):
        _AutoRegistry.auto_populate_registry()


def test_pydantic_registry_refuses_a_plain_class_in_0_3_0_words():
    class Root(PydanticClassRegistryMixin):
        @classmethod
        def __pydantic_schema_base_type__(cls) -> type:
            return cls

    with pytest.raises(
        TypeError, match="Cannot register Plain as it is not a subclass of Pydantic"
    ):
        Root.register_decorator(type("Plain", (), {}))

    class Fine(BaseModel):
        pass

    assert Root.register_decorator(Fine) is Fine


# ------------------------------------------------------------- auto-importer: 0.3.0 shape


def test_auto_importer_without_a_package_says_it_must_be_set():
    class NoPackage(AutoImporterMixin):
        pass

    with pytest.raises(ValueError, match="'auto_package' must be set.*NoPackage"):
        NoPackage.auto_import_package_modules()


def test_auto_importer_takes_walk_packages_entries_as_plain_tuples():
    """0.3.0 unpacked (finder, name, ispkg); code that mocks walk_packages gives tuples."""

    class Importer(AutoImporterMixin):
        auto_package = "pkg"
        auto_ignore_modules = ("pkg.skipped",)

    package = mock.MagicMock(__path__=["pkg"], __name__="pkg")
    entries = [
        (None, "pkg.a", False),
        (None, "pkg.sub", True),
        (None, "pkg.skipped", False),
        (None, "pkg.b", False),
    ]
    with (
        mock.patch("pkgutil.walk_packages", return_value=entries),
        mock.patch("importlib.import_module", return_value=package) as import_module,
    ):
        Importer.auto_import_package_modules()
    assert Importer.auto_imported_modules == ["pkg.a", "pkg.b"]
    import_module.assert_any_call("pkg")


# ---------------------------------------------------------- SpeculatorModel: wording, checks


@SpeculatorModelConfig.register("last_mile_test_config")
class _LastMileConfig(SpeculatorModelConfig):
    speculators_model_type: Literal["last_mile_test_config"] = "last_mile_test_config"


@SpeculatorModel.register("last_mile_test_model")
class _LastMileModel(SpeculatorModel):
    config_class: ClassVar[type[_LastMileConfig]] = _LastMileConfig  # type: ignore[misc]

    def __init__(self, config, verifier=None, verifier_attachment_mode=None):
        super().__init__(
            config, verifier=verifier, verifier_attachment_mode=verifier_attachment_mode
        )
        self.proj = nn.Linear(2, 2)
        self.post_init()


def _config() -> _LastMileConfig:
    return _LastMileConfig(
        speculators_config=SpeculatorsConfig(
            algorithm="test",
            proposal_methods=[GreedyTokenProposalConfig()],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=[]),
        )
    )


def test_model_construction_errors_start_with_0_3_0_sentences():
    with pytest.raises(
        ValueError, match="^Config must be provided to initialize a SpeculatorModel"
    ):
        SpeculatorModel(config=None)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="^Expected config to be an instance of SpeculatorModelConfig"
    ):
        SpeculatorModel(config="a string")  # type: ignore[arg-type]
    # A wrong verifier or mode is refused by the constructor itself, as in 0.3.0.
    with pytest.raises(
        TypeError, match="^Expected verifier to be a PreTrainedModel, a string path,"
    ):
        SpeculatorModel(config=_config(), verifier=123)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^Invalid verifier_attachment_mode: sideways"):
        SpeculatorModel(
            config=_config(), verifier="some/verifier", verifier_attachment_mode="sideways"
        )  # type: ignore[arg-type]


def test_model_method_errors_start_with_0_3_0_sentences():
    model = _LastMileModel(_config())
    with pytest.raises(
        NotImplementedError, match="^The forward method is only supported on concrete"
    ):
        SpeculatorModel.forward(model)
    with pytest.raises(ValueError, match="^Invalid verifier_attachment_mode: bad"):
        model.attach_verifier("some/verifier", mode="bad")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="^Verifier is already detached"):
        model.detach_verifier()
    # "full" mode refuses a second verifier even when the attribute was cleared by hand.
    model.verifier_attachment_mode = "full"
    with pytest.raises(
        RuntimeError,
        match="^Cannot attach a verifier when the speculator is not in "
        "detached mode.*detach_verifier",
    ):
        model.attach_verifier(mock.MagicMock(spec=nn.Module))
    with pytest.raises(
        TypeError, match="^Expected config to be an instance of SpeculatorModelConfig"
    ):
        SpeculatorModel.registered_model_class_from_config("a string")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="^Received a SpeculatorModelConfig instance but expected a subclass"
    ):
        SpeculatorModel.registered_model_class_from_config(
            SpeculatorModelConfig(speculators_model_type="last_mile_test_config")
        )


def test_from_pretrained_errors_start_with_0_3_0_sentences():
    with pytest.raises(
        ValueError, match="^Either `config` or `pretrained_model_name_or_path` must"
    ):
        SpeculatorModel.from_pretrained(None)
    with pytest.raises(ValueError, match="^Either `pretrained_model_name_or_path` or `state_dict`"):
        SpeculatorModel.from_pretrained(None, config=_config())
    with pytest.raises(
        TypeError, match="^Expected config to be an instance of SpeculatorModelConfig"
    ):
        SpeculatorModel.from_pretrained("somewhere", config="not a config")


def test_config_loading_errors_start_with_0_3_0_sentences(tmp_path: Path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(
        NotImplementedError, match="^Loading a non-speculator model config is not supported yet"
    ):
        SpeculatorModelConfig.from_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match="^The config dictionary must contain the 'speculators_model_type' field"
    ):
        SpeculatorModelConfig.from_dict({"model_type": "llama"})


def test_eagle_layer_config_without_a_causal_lm_is_refused_in_0_3_0_words():
    from transformers import PretrainedConfig

    from speculators_vllm016.models.eagle import _modeling_module_for

    class NoCausalLM(PretrainedConfig):
        model_type = "no_causal_lm_here"

    with pytest.raises(TypeError, match="is not a valid causal language model config class"):
        _modeling_module_for(NoCausalLM())


# -------------------------------------------------------------- TokenProposalConfig as root


def test_base_proposal_config_carries_the_named_methods_fields():
    """0.3.0: `TokenProposalConfig(proposal_type="greedy")` has greedy's fields as attributes."""
    config = TokenProposalConfig(proposal_type="greedy", speculative_tokens=4)
    assert type(config) is TokenProposalConfig
    assert config.speculative_tokens == 4  # type: ignore[attr-defined]
    assert config.verifier_accept_k == 1  # type: ignore[attr-defined]
    assert config.model_dump() == {"proposal_type": "greedy"}
    # A type that is not registered keeps only its own field.
    assert not hasattr(TokenProposalConfig(proposal_type="unregistered"), "speculative_tokens")


# ------------------------------------------- convert.eagle.utils: names patched, 0.3.0 calls


def test_hub_download_goes_through_the_patchable_snapshot_download(tmp_path: Path):
    from speculators_vllm016.convert.eagle import utils

    with mock.patch.object(utils, "snapshot_download", return_value=str(tmp_path)) as download:
        assert utils.download_checkpoint_from_hub("org/draft", cache_dir="c") == tmp_path
    download.assert_called_once_with(
        repo_id="org/draft",
        allow_patterns=["*.json", "*.safetensors", "*.bin", "*.index.json"],
        cache_dir="c",
    )
    with (
        mock.patch.object(utils, "snapshot_download", side_effect=OSError("offline")),
        pytest.raises(FileNotFoundError, match="^Checkpoint not found: org/draft.*offline"),
    ):
        utils.download_checkpoint_from_hub("org/draft")
    # ensure_checkpoint_is_local names its argument as 0.3.0 did (callers assert the call).
    with mock.patch.object(utils, "download_checkpoint_from_hub", return_value=tmp_path) as hub:
        utils.ensure_checkpoint_is_local("org/not-a-local-folder")
    hub.assert_called_once_with(model_id="org/not-a-local-folder", cache_dir=None)


def test_checkpoint_config_and_weights_errors_start_with_0_3_0_sentences(tmp_path: Path):
    from speculators_vllm016.convert.eagle import utils

    with pytest.raises(FileNotFoundError, match="^No config.json found at"):
        utils.load_checkpoint_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="^No weights found at"):
        utils.load_checkpoint_weights(tmp_path)


def test_checkpoint_weights_read_through_patchable_safe_open_and_torch_load(tmp_path: Path):
    """model.safetensors wins over pytorch_model.bin; a .bin is read with weights_only=True."""
    import torch

    from speculators_vllm016.convert.eagle import utils

    (tmp_path / "model.safetensors").touch()
    (tmp_path / "pytorch_model.bin").touch()
    handle = mock.MagicMock()
    handle.keys.return_value = ["a"]
    handle.get_tensor.return_value = torch.ones(1)
    with mock.patch.object(utils, "safe_open") as safe_open:
        safe_open.return_value.__enter__.return_value = handle
        assert list(utils.load_checkpoint_weights(tmp_path)) == ["a"]
    safe_open.assert_called_once()
    (tmp_path / "model.safetensors").unlink()
    with mock.patch.object(utils.torch, "load", return_value={"b": torch.ones(1)}) as load:
        assert list(utils.load_checkpoint_weights(tmp_path)) == ["b"]
    load.assert_called_once_with(
        tmp_path / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=True
    )


def test_fusion_detection_logs_0_3_0_sentences():
    import torch

    from speculators_vllm016.convert.eagle import utils

    with mock.patch.object(utils, "logger") as logger:
        utils.detect_fusion_bias_and_layernorms(
            {"fc.bias": torch.ones(1), "embed_layernorm.weight": torch.ones(1)}
        )
    logger.info.assert_any_call("Detected fusion bias in checkpoint")
    logger.info.assert_any_call("Detected extra layernorms in checkpoint")


def test_resolve_file_takes_0_3_0_two_arguments(tmp_path: Path):
    from speculators_vllm016.utils.loading import _resolve_file

    (tmp_path / "config.json").write_text("{}")
    assert _resolve_file(tmp_path, "config.json") == tmp_path / "config.json"
    assert _resolve_file(tmp_path, "absent.json") is None


# ------------------------------------------------- Eagle3Converter: 0.3.0's config builders

RESEARCH_CONFIG = {
    "target_vocab_size": 1000,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
}


def test_eagle3_converter_builds_configs_as_0_3_0_did():
    from speculators_vllm016.convert.eagle.eagle3_converter import Eagle3Converter

    converter = Eagle3Converter()
    target = "speculators_vllm016.convert.eagle.eagle3_converter.PretrainedConfig.get_config_dict"
    with mock.patch(
        target,
        return_value=(
            {"max_position_embeddings": 131072, "architectures": ["LlamaForCausalLM"]},
            {},
        ),
    ):
        layer = converter._create_transformer_config_from_eagle(dict(RESEARCH_CONFIG), "org/v")
        assert layer.max_position_embeddings == 131072  # the larger of draft and verifier
        assert layer.rope_theta == 10000.0 and layer.vocab_size == 1000
        assert layer.num_hidden_layers == 1
        layered = converter._create_transformer_config_from_eagle(
            {**RESEARCH_CONFIG, "num_hidden_layers": 3}, "org/v"
        )
        assert layered.num_hidden_layers == 3
        config = converter._build_eagle3_speculator_config(
            dict(RESEARCH_CONFIG), "org/v", eagle_aux_hidden_state_layer_ids=[1, 5, 9]
        )
    assert config.speculators_config.verifier.name_or_path == "org/v"
    assert config.draft_vocab_size == 32000  # 0.3.0's default when the config names none
    assert config.to_dict()["eagle_aux_hidden_state_layer_ids"] == [1, 5, 9]
    with (
        mock.patch(target, side_effect=OSError("offline")),
        pytest.raises((RuntimeError, ValueError), match="org/v"),
    ):
        converter._create_transformer_config_from_eagle(dict(RESEARCH_CONFIG), "org/v")
