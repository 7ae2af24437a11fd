"""Data for mixln_megatron: the shipped assets and offline preprocessing to Megatron datasets.

  mixln_megatron.data.corpus      paths of the shipped Austen corpus, NLTK punkt_tab, tokenizer
  mixln_megatron.data.tokenizer   train / load the byte-level BPE (and other offline tokenizers)
  mixln_megatron.data.preprocess  text -> <prefix>.bin/.idx (`mixln-megatron preprocess`), over
                                  read_input, encode, indexed_output and report
  mixln_megatron.data.austen_dataset  prepare_austen_dataset(): the demo's cached dataset

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
from .austen_dataset import prepare_austen_dataset
from .preprocess import build_from_documents, preprocess_files
from .report import PreprocessError, PreprocessStats
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
