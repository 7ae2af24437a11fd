"""Data for mixln_megatron: the shipped assets and offline preprocessing to Megatron datasets.

  mixln_megatron.data.corpus      paths of the shipped Austen corpus, NLTK punkt_tab, tokenizer
  mixln_megatron.data.tokenizer   train / load the byte-level BPE (and other offline tokenizers)
  mixln_megatron.data.preprocess  text -> <prefix>.bin/.idx (`mixln-megatron preprocess`),
                                  prepare_austen_dataset() for the demo

Importing this package is cheap: megatron, torch and transformers are imported only when a
dataset is written or a Hugging Face tokenizer directory is loaded.
"""

from .corpus import (
    AssetsMissingError,
    TokenizerFiles,
    assets_dir,
    austen_paragraphs,
    austen_text_path,
    nltk_data_dir,
    punkt_dir,
    read_austen,
    sentence_splitter,
    tokenizer_dir,
    tokenizer_files,
    use_shipped_punkt,
)
from .preprocess import (
    PreprocessError,
    PreprocessStats,
    build_from_documents,
    prepare_austen_dataset,
    preprocess_files,
)
from .tokenizer import (
    EOD_TOKEN,
    TextTokenizer,
    TokenizerSpec,
    load_tokenizer,
    shipped_tokenizer_spec,
    train_bpe,
)

__all__ = [
    "AssetsMissingError",
    "EOD_TOKEN",
    "PreprocessError",
    "PreprocessStats",
    "TextTokenizer",
    "TokenizerFiles",
    "TokenizerSpec",
    "assets_dir",
    "austen_paragraphs",
    "austen_text_path",
    "build_from_documents",
    "load_tokenizer",
    "nltk_data_dir",
    "prepare_austen_dataset",
    "preprocess_files",
    "punkt_dir",
    "read_austen",
    "sentence_splitter",
    "shipped_tokenizer_spec",
    "tokenizer_dir",
    "tokenizer_files",
    "train_bpe",
    "use_shipped_punkt",
]
