//! `tierzero generate`: continue a prompt (text, chat messages or token ids) with a
//! checkpoint or a Hugging Face directory, greedy or sampled.

use super::common::Failure;
use clap::Args;
use std::path::PathBuf;
use tierzero::model::generate::Sampling;
use tierzero::run::generate::{Generator, Prompt, Weights};

#[derive(Args)]
pub struct GenerateArgs {
    /// A checkpoint directory (`runs/NAME/checkpoints/latest`).
    pub checkpoint: Option<PathBuf>,
    /// A Hugging Face model directory instead of a checkpoint.
    #[arg(long)]
    pub hf: Option<PathBuf>,
    /// Text to continue.
    #[arg(long, conflicts_with_all = ["chat", "prompt_ids"])]
    pub prompt: Option<String>,
    /// A JSON file of chat messages ([{"role", "content"}, …], or {"messages": …}),
    /// rendered with the model's chat template and its generation prompt.
    #[arg(long, conflicts_with = "prompt_ids")]
    pub chat: Option<PathBuf>,
    /// Token ids to continue, comma-separated (models trained without a tokenizer).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Vec<i64>,
    /// A tokenizer.json in place of the one the weights were trained with.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// 0 (the default) picks the most likely token.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print {"prompt_ids", "ids", "text"} as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: GenerateArgs) -> Result<(), Failure> {
    let fail = |message: String| Failure::Other(anyhow::anyhow!(message));
    let weights = match (&args.checkpoint, &args.hf) {
        (Some(dir), None) => Weights::Checkpoint(dir),
        (None, Some(dir)) => Weights::Hf(dir),
        _ => {
            return Err(fail(
                "give a checkpoint directory or --hf DIR (one of them)".into(),
            ))
        }
    };
    if !(0.0..=1.0).contains(&args.top_p) || args.top_p == 0.0 || args.temperature < 0.0 {
        return Err(fail("--top-p is in (0, 1] and --temperature ≥ 0".into()));
    }
    let prompt = match (&args.prompt, &args.chat) {
        (Some(text), _) => Prompt::Text(text.clone()),
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file).map_err(|e| fail(format!("{}: {e}", file.display())))?;
            let value: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| fail(format!("{}: not JSON: {e}", file.display())))?;
            let messages = value.get("messages").unwrap_or(&value);
            let messages = messages
                .as_array()
                .ok_or_else(|| fail(format!("{}: not a list of chat messages", file.display())))?;
            Prompt::Chat(messages.clone())
        }
        (None, None) if !args.prompt_ids.is_empty() => Prompt::Ids(args.prompt_ids.clone()),
        (None, None) => return Err(fail("give --prompt, --chat or --prompt-ids".into())),
    };
    let device = if tch::Cuda::is_available() {
        tch::Device::Cuda(0)
    } else {
        tch::Device::Cpu
    };
    let generator =
        Generator::open(weights, args.tokenizer.as_deref(), device).map_err(anyhow::Error::from)?;
    let ids = generator.encode(&prompt).map_err(anyhow::Error::from)?;
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    let new = generator
        .generate(&ids, args.max_new_tokens, &sampling)
        .map_err(anyhow::Error::from)?;
    let text = generator.decode(&new);
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "prompt_ids": ids, "ids": new, "text": text })
        );
    } else {
        match text {
            Some(text) => println!("{text}"),
            None => println!("{}", new.iter().map(i64::to_string).collect::<Vec<_>>().join(",")),
        }
    }
    Ok(())
}
