"""Can the installed vLLM serve an EAGLE-3 draft for this target? Answered before any long work.

vLLM 0.16 serves an EAGLE-3 draft only when two of its own checks pass: `SpeculativeConfig`
accepts the target's text model type (a fixed list in `vllm/config/speculative.py`), and the
target's model class implements `SupportsEagle3` (the GPU runner refuses it otherwise). This
package's vLLM plugin (`speculators_vllm016.vllm_plugin`) adds both for DeepSeek-V2/V3, Kimi-K2
and Kimi-K2.5, unless it is switched off.

`eagle3_serving_verdict` is the pure decision, from the target's architectures and text model
type plus the facts read from the installed vLLM; `installed_vllm_facts` reads those facts from
vLLM's source files (no import of vLLM, no engine, no GPU). The plugin's own constants live here
too, so that this low layer and the plugin agree on what it covers.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speculators_vllm016.utils.vllm_sources import (
    class_implements,
    eagle3_target_types,
    registered_model_class,
    vllm_package_dir,
    vllm_version,
)

__all__ = [
    "PLUGIN_ARCHITECTURES",
    "PLUGIN_ENTRY_POINT",
    "PLUGIN_ENV",
    "PLUGIN_TEXT_MODEL_TYPES",
    "ServingVerdict",
    "VllmEagle3Facts",
    "eagle3_serving_verdict",
    "installed_vllm_facts",
    "plugin_enabled",
    "plugin_installed",
    "serving_line",
    "target_identity",
    "target_serving_line",
]

PLUGIN_ENV = "SPECULATORS_VLLM_PLUGIN"  # "0" (or false/no/off) switches the plugin off
PLUGIN_ENTRY_POINT = "speculators_eagle3"  # its name in the vllm.general_plugins group
# The model classes the plugin gives the EAGLE-3 interface (Kimi-K2 ships DeepseekV3ForCausalLM).
PLUGIN_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",
)
# What the plugin adds to SpeculativeConfig's list; vLLM matches them as substrings of
# `hf_text_config.model_type` (Kimi-K2.5's text model type is deepseek_v3, Kimi-K2's kimi_k2).
PLUGIN_TEXT_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def plugin_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False when the user switched the plugin off, or `VLLM_PLUGINS` leaves it out."""
    environ = os.environ if environ is None else environ
    if environ.get(PLUGIN_ENV, "1").strip().lower() in {"0", "false", "no", "off"}:
        return False
    allowed = environ.get("VLLM_PLUGINS")
    return allowed is None or PLUGIN_ENTRY_POINT in [p.strip() for p in allowed.split(",")]


@dataclass(frozen=True)
class VllmEagle3Facts:
    """What the installed vLLM says, read without starting anything."""

    version: str
    accepted_text_model_types: tuple[str, ...]  # vLLM's own list, as shipped
    class_supports_eagle3: Mapping[str, bool | None]  # vLLM's own class; None: not registered
    plugin_installed: bool  # the entry point is registered for this environment


@dataclass(frozen=True)
class ServingVerdict:
    servable: bool
    via_plugin: bool
    causes: tuple[str, ...]  # why not (empty when servable)


def eagle3_serving_verdict(
    architectures: Iterable[str],
    text_model_type: str,
    facts: VllmEagle3Facts,
    plugin_on: bool,
) -> ServingVerdict:
    """Both of vLLM's checks, by vLLM alone first, then with the plugin where it applies."""
    architectures = list(architectures)
    type_ok = any(name in text_model_type for name in facts.accepted_text_model_types)
    class_ok = any(facts.class_supports_eagle3.get(arch) for arch in architectures)
    if type_ok and class_ok:
        return ServingVerdict(True, False, ())
    plugin_covers = any(arch in PLUGIN_ARCHITECTURES for arch in architectures) and any(
        name in text_model_type for name in PLUGIN_TEXT_MODEL_TYPES
    )
    if plugin_covers and facts.plugin_installed and plugin_on:
        return ServingVerdict(True, True, ())
    causes = []
    if not type_ok:
        causes.append(
            f"text model type {text_model_type!r} is not in vLLM {facts.version}'s EAGLE-3 list "
            f"({', '.join(facts.accepted_text_model_types)})"
        )
    if not class_ok:
        names = ", ".join(architectures) or "no architecture"
        unknown = [a for a in architectures if facts.class_supports_eagle3.get(a) is None]
        if unknown and len(unknown) == len(architectures):
            causes.append(f"vLLM {facts.version} has no model class for {names}")
        else:
            causes.append(f"vLLM {facts.version}'s model class for {names} lacks SupportsEagle3")
    if plugin_covers and not facts.plugin_installed:
        causes.append(
            "this package's vLLM plugin would add both, but its entry point is not installed "
            "(reinstall speculators-vllm016)"
        )
    elif plugin_covers and not plugin_on:
        causes.append(
            f"this package's vLLM plugin would add both, but it is switched off ({PLUGIN_ENV}=0 "
            "or VLLM_PLUGINS without it)"
        )
    return ServingVerdict(False, False, tuple(causes))


def serving_line(verdict: ServingVerdict, facts: VllmEagle3Facts) -> str:
    """The one start-up line datagen and train print."""
    if verdict.servable and verdict.via_plugin:
        return (
            f"vLLM {facts.version} can serve an EAGLE-3 draft for this target with this "
            f"package's plugin (on; {PLUGIN_ENV}=0 switches it off)"
        )
    if verdict.servable:
        return f"vLLM {facts.version} can serve an EAGLE-3 draft for this target"
    return f"vLLM {facts.version} cannot serve an EAGLE-3 draft for this target: " + "; ".join(
        verdict.causes
    )


def _class_supports_eagle3(root: Path, arch: str) -> bool | None:
    """Whether vLLM's own class for `arch` implements SupportsEagle3 (None: not registered)."""
    registered = registered_model_class(root, arch)
    if registered is None:
        return None
    return class_implements(root, registered[0], registered[1], "SupportsEagle3")


def plugin_installed() -> bool:
    """The plugin's entry point is registered for this environment (vLLM loads it from there)."""
    from importlib.metadata import entry_points

    return any(e.name == PLUGIN_ENTRY_POINT for e in entry_points(group="vllm.general_plugins"))


def installed_vllm_facts(architectures: Iterable[str]) -> VllmEagle3Facts | None:
    """Read vLLM's list and, per architecture, whether its own model class supports EAGLE-3.

    From the installed sources (`vllm_sources`), as shipped: what the plugin changes at run time
    is accounted for by `eagle3_serving_verdict`. None when vLLM is not installed.
    """
    root = vllm_package_dir()
    if root is None:
        return None
    return VllmEagle3Facts(
        version=vllm_version(root),
        accepted_text_model_types=eagle3_target_types(root) or (),
        class_supports_eagle3={arch: _class_supports_eagle3(root, arch) for arch in architectures},
        plugin_installed=plugin_installed(),
    )


def target_identity(config: Mapping[str, Any]) -> tuple[list[str], str]:
    """A config.json's architectures and its text model's type (nested for wrappers)."""
    from speculators_vllm016.utils.text_config import text_config_of

    text = text_config_of(config)
    model_type = text.get("model_type") or config.get("model_type") or ""
    return list(config.get("architectures") or []), str(model_type)


def target_serving_line(architectures: Iterable[str], text_model_type: str) -> str:
    """The start-up line for a target; never raises (it is advice, not a gate)."""
    architectures = list(architectures)
    facts = installed_vllm_facts(architectures)
    if facts is None:
        return "vLLM is not installed: cannot say whether it can serve an EAGLE-3 draft"
    verdict = eagle3_serving_verdict(architectures, text_model_type, facts, plugin_enabled())
    return serving_line(verdict, facts)
