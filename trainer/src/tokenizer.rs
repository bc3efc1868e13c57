//! A Hugging Face `tokenizer.json` through the `tokenizers` crate.

use std::path::Path;

use crate::error::ModelError;

/// Encodes and decodes text; special tokens written in the text (chat markers) are matched.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab", &self.vocab_size())
            .finish()
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json` from a checkpoint directory or a file path.
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let inner =
            tokenizers::Tokenizer::from_file(&file).map_err(|e| ModelError::TokenizerLib {
                what: file.display().to_string(),
                source: e,
            })?;
        Ok(Self { inner })
    }

    /// Wraps an already built tokenizer.
    pub fn from_tokenizer(inner: tokenizers::Tokenizer) -> Self {
        Self { inner }
    }

    /// Token ids of `text`, without adding BOS/EOS (chat templates write them explicitly).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        self.inner
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| ModelError::TokenizerLib {
                what: "encoding".into(),
                source: e,
            })
    }

    /// Text of `ids`, special tokens included (tool-call markers are special in some vocabularies).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }

    /// Id of a token string (`<|im_end|>`), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
