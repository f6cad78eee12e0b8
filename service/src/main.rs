//! The `nebula` command: `serve` (the OpenAI-compatible API), `convert` (HF checkpoint to GGUF), `openapi` (print
//! the API's OpenAPI document).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use nebula_engine::convert::{ConvertOptions, OutType, convert};

/// Nebula: an inference server for Qwen3.8-Flash-Next (qwen4exp).
#[derive(Parser, Debug)]
#[command(name = "nebula", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the OpenAI-compatible API (the embedded demo model when no model is given). Settings: flags,
    /// NEBULA_* variables and nebula.toml (docs/config.md).
    Serve(nebula_service::ServeArgs),
    /// Print the OpenAPI document (the committed copy is openapi/openapi.json).
    Openapi,
    /// Convert a Hugging Face qwen4_exp safetensors checkpoint directory to a qwen4exp GGUF file.
    Convert {
        /// Checkpoint directory (config.json, *.safetensors, optionally tokenizer.json and chat_template.jinja).
        input: PathBuf,
        /// Output GGUF path.
        #[arg(short, long)]
        output: PathBuf,
        /// Type of the weight matrices: f32, f16, bf16 or q8_0 (norms, routers and convs stay F32).
        #[arg(long, default_value = "bf16")]
        outtype: OutType,
        /// Leave out the MTP block.
        #[arg(long)]
        no_mtp: bool,
        /// Split the output into parts of at most this many GiB of tensor data.
        #[arg(long)]
        split_max_gib: Option<f64>,
        /// `general.name` of the output.
        #[arg(long)]
        name: Option<String>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            let config = nebula_service::ServerConfig::resolve(&args)?;
            Ok(nebula_service::serve(config)?)
        }
        Command::Openapi => {
            print!("{}", nebula_service::openapi::document());
            Ok(())
        }
        Command::Convert { input, output, outtype, no_mtp, split_max_gib, name } => {
            let opts = ConvertOptions {
                out_type: outtype,
                include_mtp: !no_mtp,
                split_max_bytes: split_max_gib.map(|g| (g * (1u64 << 30) as f64) as u64),
                name,
            };
            let report = convert(&input, &output, &opts)
                .with_context(|| format!("converting {} to {}", input.display(), output.display()))?;
            for f in &report.files {
                println!("wrote {}", f.display());
            }
            println!(
                "{} tensors, {:.1} MiB of tensor data, MTP block: {}, tokenizer: {}",
                report.tensors,
                report.data_bytes as f64 / (1 << 20) as f64,
                if report.mtp { "yes" } else { "no" },
                if report.tokenizer { "yes" } else { "no" }
            );
            Ok(())
        }
    }
}
