//! Turns a conversation into tokens turn by turn: the opening prompt, each tool result as an
//! observation, and the canonical text of a tool call (how logged calls are re-tokenised).

use serde_json::Value;

use crate::chat::ChatTemplate;
use crate::error::ModelError;
use crate::tokenizer::TextTokenizer;

/// Renders and tokenises the pieces of one conversation for one checkpoint.
#[derive(Debug, Clone)]
pub struct Renderer {
    template: ChatTemplate,
    tokenizer: TextTokenizer,
    system: String,
    tools_in_prompt: bool,
    max_observation_tokens: usize,
    stop_ids: Vec<u32>,
}

impl Renderer {
    /// A renderer; `eos_ids` are the checkpoint's own end tokens (stop ids besides the
    /// template's end-of-turn token).
    pub fn new(
        template: ChatTemplate,
        tokenizer: TextTokenizer,
        system: String,
        tools_in_prompt: bool,
        max_observation_tokens: usize,
        eos_ids: &[u32],
    ) -> Result<Self, ModelError> {
        let eot = tokenizer.token_id(template.end_of_turn()).ok_or_else(|| {
            ModelError::Tokenizer(format!(
                "the vocabulary lacks the end-of-turn token {}",
                template.end_of_turn()
            ))
        })?;
        let mut stop_ids = vec![eot];
        stop_ids.extend(eos_ids.iter().copied().filter(|&id| id != eot));
        Ok(Self {
            template,
            tokenizer,
            system,
            tools_in_prompt,
            max_observation_tokens,
            stop_ids,
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// The chat template.
    pub fn template(&self) -> ChatTemplate {
        self.template
    }

    /// Token ids that end an assistant turn.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// System prompt (with the tool schemas when configured), the task, and the opening of
    /// the first assistant turn.
    pub fn prompt(&self, task_text: &str, tools: &[Value]) -> Result<Vec<u32>, ModelError> {
        let tools: &[Value] = if self.tools_in_prompt { tools } else { &[] };
        self.tokenizer
            .encode(&self.template.prompt(&self.system, tools, task_text))
    }

    /// A tool result and the opening of the next assistant turn. `turn` holds the tokens the
    /// policy just produced, so the template closes the turn only when the policy did not.
    /// Results longer than the observation budget keep their head and tail.
    pub fn observation(
        &self,
        text: &str,
        is_error: bool,
        turn: &[u32],
    ) -> Result<Vec<u32>, ModelError> {
        let text = if is_error {
            format!("Error: {text}")
        } else {
            text.to_string()
        };
        let text = self.cut_middle(&text)?;
        let after_turn = turn.last().is_some_and(|t| self.stop_ids.contains(t));
        self.tokenizer
            .encode(&self.template.observation(&text, after_turn))
    }

    /// The canonical text of one assistant turn calling `name` with `arguments`, ending the
    /// turn (what a policy trained on it should produce).
    pub fn call_text(&self, name: &str, arguments: &Value) -> String {
        format!(
            "{}{}",
            crate::chat::call_block(name, arguments),
            self.template.end_of_turn()
        )
    }

    /// Tokens of `call_text`.
    pub fn call_tokens(&self, name: &str, arguments: &Value) -> Result<Vec<u32>, ModelError> {
        self.tokenizer.encode(&self.call_text(name, arguments))
    }

    /// Text of generated tokens with a trailing end-of-turn marker removed (what the tool-call
    /// parser sees).
    pub fn turn_text(&self, turn: &[u32]) -> String {
        let body = match turn.last() {
            Some(t) if self.stop_ids.contains(t) => &turn[..turn.len() - 1],
            _ => turn,
        };
        self.tokenizer.decode(body)
    }

    fn cut_middle(&self, text: &str) -> Result<String, ModelError> {
        let ids = self.tokenizer.encode(text)?;
        let max = self.max_observation_tokens.max(16);
        if ids.len() <= max {
            return Ok(text.to_string());
        }
        let head = max / 2;
        let tail = max - head;
        let cut = ids.len() - head - tail;
        Ok(format!(
            "{}\n[... {cut} tokens cut ...]\n{}",
            self.tokenizer.decode(&ids[..head]),
            self.tokenizer.decode(&ids[ids.len() - tail..])
        ))
    }
}
