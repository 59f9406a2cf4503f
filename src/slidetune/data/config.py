"""Configuration of the data pipeline."""
from __future__ import annotations

from dataclasses import dataclass

from ..fields import check_fields
from .chat_template import check_chat_template_setting
from .formats import ColumnMap

PACKING_MODES = ("masked", "causal", "off")
STREAMING_MODES = ("auto", "on", "off")
_STREAMING_ALIASES = {"true": "on", "yes": "on", "1": "on", "false": "off", "no": "off", "0": "off"}
# how packed rows are cut (TRL's names): whole examples best-fit (bfd) or windows of the stream
PACKING_STRATEGIES = ("auto", "bfd", "wrapped")
# the formats whose examples are a prompt and its reply: packed whole by packing_strategy auto
INSTRUCTION_FORMATS = ("chat", "prompt_completion", "alpaca")
# the boolean spelling of the flag before the modes existed (`--packing true|false`)
_PACKING_ALIASES = {"true": "masked", "on": "masked", "yes": "masked", "1": "masked",
                    "false": "off", "no": "off", "0": "off"}

# the ranges of DataConfig's numbers (checked with every field's type by fields.check_fields)
_RULES = {"seq_len": (lambda v: v >= 1, ">= 1"), "heldout_fraction": (lambda v: 0.0 <= v < 1.0, "in [0, 1)")}


@dataclass
class DataConfig:
    # None -> the built-in English corpus (corpus.py, no download); otherwise a .txt or .jsonl
    # file (formats.py); a parquet/JSON/CSV/arrow file or directory of them, a `datasets`
    # save_to_disk directory or a Hub dataset id `org/name` (hf_datasets.py, through `datasets`);
    # or a pre-tokenized corpus read memory-mapped (token_arrays.py): a .bin/.npy token-id array
    # or a save_to_disk directory with an input_ids column. Several record sources mixed with
    # weights: "a.jsonl:0.7,b/:0.3" (mixture.py).
    path: str | None = None
    # A separate evaluation set, any source `path` takes but a pre-tokenized one: evaluated instead
    # of a held-out split of `path` (which then trains whole; heldout_fraction is not used).
    eval_path: str | None = None
    # The split of a Hub id or a data directory to train on: None -> "train", or the only split.
    split: str | None = None
    # The configuration (subset) of a Hub dataset that has several, as load_dataset's `name`.
    subset: str | None = None
    # The data's own column names for the record fields, "COLUMN=FIELD,...": "content=text",
    # "question=prompt,answer=completion" (formats.ColumnMap; the --eval-data set's too).
    columns: str | None = None
    # Read the source through `datasets` streaming (never all of it in RAM): its records are
    # tokenized a chunk at a time into a token file in the cache, trained on memory-mapped.
    # auto: when the source's files are large against the available RAM (hf_datasets.py).
    streaming: str = "auto"
    # Where tokenized data is kept between runs (token_cache.py): None -> the `datasets`
    # cache's slidetune/ directory (HF_DATASETS_CACHE); "off": nothing is kept.
    cache_dir: str | None = None
    # dtype of a raw .bin token file: uint16 (nanoGPT's prepare.py; vocabularies up to 65536)
    # or uint32. A .npy file carries its own.
    token_dtype: str = "uint16"
    # Tokens per training sequence (the model's input length S). 256 matches the T1M1
    # benchmark shape and keeps CPU tests fast; real fine-tuning usually wants 1024-4096.
    seq_len: int = 256
    # How rows are made:
    #   masked: several documents share a row of seq_len+1 tokens (packing_strategy: whole
    #           examples, or windows of the stream); each token attends only to its own document
    #           and position ids restart at each document, so a packed row trains like its
    #           documents run alone
    #           (what instruction/chat fine-tuning wants; transformers' packed-sequence mask).
    #   causal: packed the same way but unmasked: documents attend to the documents before
    #           them in the row (the usual trade of packed pretraining corpora).
    #   off:    one example per row, truncated to seq_len+1 tokens and right-padded.
    # The old spelling stays accepted: true -> masked (packing on), false -> off.
    # A split too small to fill one batch of packed rows (a few dozen short examples) falls
    # back to one example per row, with a note (build.py).
    packing: str = "masked"
    # How packed rows are cut: bfd packs whole examples (best-fit decreasing) into rows of up to
    # seq_len+1 tokens, padded, so no reply is cut from its prompt (an example longer than that is
    # truncated, with a warning); wrapped cuts the concatenated examples into full windows (a
    # window may start mid-example). auto: bfd for chat, prompt/completion and alpaca data,
    # wrapped for plain text. Applies when packing is masked or causal.
    packing_strategy: str = "auto"
    # The Jinja chat template that renders chat data: a file, or the name of one shipped with
    # slidetune (qwen3, phi3.5: the published templates with the assistant's text marked by
    # {% generation %}, so multi-turn chats train on every assistant turn). None: the tokenizer's.
    chat_template: str | None = None
    # Fraction of documents/examples held out for evaluation, chosen by a seeded permutation.
    # 5% of the ~1 MB built-in corpus is ~12K tokens: enough for a stable perplexity. Data sets
    # of fewer than 10 examples train without a held-out split (with a note); from 10 up at
    # least one example is held out.
    heldout_fraction: float = 0.05
    # chat / prompt-completion / alpaca data: prompt tokens get label -100, so the loss is
    # the completion's only (the usual SFT recipe). Plain text is always fully supervised.
    mask_prompt: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        mode = str(self.packing).strip().lower()
        self.packing = _PACKING_ALIASES.get(mode, mode)
        if self.packing not in PACKING_MODES:
            raise ValueError(f"DataConfig.packing must be one of {', '.join(PACKING_MODES)} (or the old "
                             f"true/false), got {self.packing!r}: --packing masked keeps documents apart, "
                             f"--packing causal lets them attend to each other, --packing off pads")
        mode = str(self.streaming).strip().lower()
        self.streaming = _STREAMING_ALIASES.get(mode, mode)
        if self.streaming not in STREAMING_MODES:
            raise ValueError(f"DataConfig.streaming must be one of {', '.join(STREAMING_MODES)}, got "
                             f"{self.streaming!r}")
        check_fields(self, "data", rules=_RULES)     # types and ranges (fields.py), after the spellings above
        if self.packing_strategy not in PACKING_STRATEGIES:
            raise ValueError(f"DataConfig.packing_strategy must be one of {', '.join(PACKING_STRATEGIES)}, got "
                             f"{self.packing_strategy!r}: bfd packs whole examples, wrapped cuts windows")
        check_chat_template_setting(self.chat_template)
        ColumnMap.parse(self.columns)                # its syntax and fields, before anything is read
        if self.token_dtype not in ("uint16", "uint32"):
            raise ValueError(f"DataConfig.token_dtype must be uint16 or uint32, got {self.token_dtype!r}")

    @property
    def column_map(self) -> "ColumnMap | None":
        return ColumnMap.parse(self.columns)

    @property
    def packed(self) -> bool:
        """Rows hold several documents (masked or causal)."""
        return self.packing != "off"

    def packs_whole_examples(self, data_format: str) -> bool:
        """Whether packed rows of ``data_format`` data are whole examples (bfd), not windows."""
        if self.packing_strategy == "auto":
            return data_format in INSTRUCTION_FORMATS
        return self.packing_strategy == "bfd"
