"""`final/` as a model repository holds it (issue 48): what `save_checkpoint(..., export=...)`
writes beside the weights, config and tokenizer, and nothing a repository should not carry.

- No trainer state: no `trainer_state/` (its `rng.pt` is a pickle, which the Hub's scanner flags,
  and a model needs neither RNG states nor a state.json); the manifest and COMPLETE stay (they are
  JSON: what was written, checked when read).
- The source's `generation_config.json`, byte for byte (its sampling defaults and extra EOS ids are
  the model's; rebuilding it from config.json loses them), where the source has one.
- The chat template the run trained with (`--chat-template`), saved with the tokenizer, so a base
  model trained on a template ships with it and `AutoTokenizer` renders chats as training did.
- A model card, `README.md`: the base model, the data and its sizes, the recipe and its flags,
  the held-out loss before and after, slidetune's version (`model_card`).
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GENERATION_CONFIG = "generation_config.json"
MODEL_CARD = "README.md"


@dataclass(frozen=True)
class ModelExport:
    """What `final/` carries besides the weights: see the module docstring."""
    source_dir: Path | None = None          # the model's directory (its generation_config.json)
    chat_template: str | None = None        # the template the run trained with, if not the tokenizer's own
    card: str | None = None                 # README.md's text


def write_export_files(directory: Path, export: ModelExport, tokenizer: Any) -> None:
    """The export's files into `directory` (the checkpoint being written): the tokenizer with the
    run's chat template, the source's generation config over the one rebuilt from config.json, the
    model card."""
    if tokenizer is not None:
        own = getattr(tokenizer, "chat_template", None)
        if export.chat_template is not None:
            tokenizer.chat_template = export.chat_template
        try:
            tokenizer.save_pretrained(str(directory))
        finally:
            tokenizer.chat_template = own          # the run's tokenizer as it was
    source = export.source_dir / GENERATION_CONFIG if export.source_dir is not None else None
    if source is not None and source.is_file():
        shutil.copyfile(source, directory / GENERATION_CONFIG)
    if export.card is not None:
        (directory / MODEL_CARD).write_text(export.card, encoding="utf-8")


@dataclass
class CardFacts:
    """What the model card says, gathered by the trainer at the end of a run."""
    base_model: str
    data: list[str]                          # each source's line (path and size)
    flags: dict[str, Any]                    # the run's settings as `train` records them
    steps: int
    loss_before: float | None = None
    loss_after: float | None = None
    notes: list[str] = field(default_factory=list)


def model_card(facts: CardFacts) -> str:
    """README.md of a fine-tuned model: YAML front matter (base_model, library_name, tags) then the
    run in prose and tables."""
    from .. import __version__
    base = facts.base_model
    hub_id = base if base.count("/") == 1 and not Path(base).exists() else None
    front = ["---"] + ([f"base_model: {hub_id}"] if hub_id else []) + [
        "library_name: transformers", "tags:", "- slidetune", "- full-parameter fine-tuning", "---", ""]
    lines = [f"# Fine-tuned {Path(base).name or base}", "",
             f"Full-parameter fine-tune of `{base}` with slidetune {__version__}, {facts.steps} optimizer steps.", "",
             "## Data", ""] + [f"- {d}" for d in facts.data] + ["", "## Held-out loss", ""]
    if facts.loss_before is not None and facts.loss_after is not None:
        lines += ["| before | after |", "|---|---|", f"| {facts.loss_before:.4f} | {facts.loss_after:.4f} |", ""]
    else:
        lines += ["No held-out evaluation was run.", ""]
    lines += ["## Recipe", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | `{_cell(v)}` |" for k, v in sorted(_flat(facts.flags).items())]
    lines += [""] + facts.notes
    return "\n".join(front + lines).rstrip() + "\n"


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("`", "'").replace("\n", " ")


def run_export(base_model: str, source_dir: Path | None, chat_template: str | None, data: list[str],
               run_record: dict[str, Any], steps: int, before: tuple[float, float] | None,
               after: tuple[float, float] | None) -> ModelExport:
    """The export of a finished run: `chat_template` the --chat-template text it trained with (None:
    the tokenizer's own), `data` each source's line, `run_record` the settings state.json records,
    `before` / `after` the held-out (loss, perplexity)."""
    facts = CardFacts(base_model, data, run_record, steps, before[0] if before else None,
                      after[0] if after else None)
    return ModelExport(source_dir, chat_template, model_card(facts))
