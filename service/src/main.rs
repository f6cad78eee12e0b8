//! The `nebula` command: `serve` (the OpenAI-compatible API), `convert` (HF checkpoint or GGUF to GGUF),
//! `openapi` (print the API's OpenAPI document), `profile detect` (the hardware profile the container entry point
//! writes before `serve`), `synth` (random-weight real-width GGUF for benchmarks), `bench` (speed), `generate`
//! (greedy continuation), `hotlist` (the routing campaign ranking experts for placement).

mod bench;

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use nebula_engine::convert::{
    ConvertOptions, ImportanceMatrix, OutType, QuantRecipe, RecipeName, convert, requantize_with,
};

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
    /// Convert a Hugging Face qwen4_exp safetensors checkpoint directory to a qwen4exp GGUF file, or requantize a
    /// GGUF file with --recipe / --recipe-from.
    Convert {
        /// Checkpoint directory (config.json, *.safetensors, optionally tokenizer.json and chat_template.jinja), or
        /// a .gguf file to requantize.
        input: PathBuf,
        /// Output GGUF path (may be left out with --mmproj: then only the vision tower is written).
        #[arg(short, long, required_unless_present = "mmproj")]
        output: Option<PathBuf>,
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
        /// Quantization recipe: nebula-q4 (the product's component table), q8_0 (ggml-org's Q8_0 files),
        /// ud-q4_k_xl (Unsloth's UD-Q4_K_XL mix) or iq4_xs (llama.cpp's IQ4_XS mix). Overrides --outtype for
        /// the weights it quantizes.
        #[arg(long, conflicts_with = "recipe_from")]
        recipe: Option<RecipeName>,
        /// Copy the type of every tensor from this published GGUF (its first part when split); tensors it
        /// lacks take the nebula-q4 type.
        #[arg(long)]
        recipe_from: Option<PathBuf>,
        /// Importance matrix from llama.cpp's `llama-imatrix` (GGUF or legacy .dat): the quantized weights it
        /// covers are fitted with its per-column weights (every quantized type but Q8_0 and MXFP4).
        #[arg(long)]
        imatrix: Option<PathBuf>,
        /// Also write the checkpoint's vision tower (`model.visual.*`) to this file as a llama.cpp mmproj GGUF
        /// (architecture `clip`, projector `qwen3vl_merger`), for `nebula serve --mmproj`.
        #[arg(long)]
        mmproj: Option<PathBuf>,
    },
    /// Write a random-weight qwen4exp GGUF at the real widths (benchmarks, placement studies).
    Synth(nebula_service::cli::synth::SynthArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Greedy continuation of a raw text prompt (engine comparisons).
    Generate(nebula_service::cli::generate::GenerateArgs),
    /// Gather an importance matrix over a calibration text for `nebula convert --imatrix` (llama.cpp's GGUF
    /// imatrix format, as `llama-imatrix` writes).
    Imatrix(nebula_service::cli::imatrix::ImatrixArgs),
    /// Hardware profiles: `nebula profile detect` chooses one of deploy/profiles.toml and writes it.
    Profile(nebula_service::profile::ProfileArgs),
    /// Routing campaign over a prompt set: ranks each layer's experts (count, then router weight) and writes the
    /// hotlist file that placement uses (`--hotlist`, `placement.hotlist`).
    Hotlist(nebula_service::cli::hotlist::HotlistArgs),
}

// Parsed once at start: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Prefill and decode speed at context frontiers on a backend.
    Model(nebula_service::cli::bench::BenchModelArgs),
    /// CPU kernels: memory read bandwidth and expert matrix-vector throughput of each weight type.
    Kernels(bench::KernelBenchArgs),
    /// MTP speculative decoding: tok/s off and on per accuracy level, acceptance, time split, and the machinery's
    /// cost at fixed acceptance rates (CPU, or the GPU with `--backend cuda`).
    Mtp(nebula_service::cli::bench::BenchMtpArgs),
    /// Prefix cache: time to first token of a follow-up turn resumed from the cache against a cold prefill of
    /// the same prompt, at conversation sizes (CPU, or the GPU with `--backend cuda`).
    Prefix(nebula_service::cli::bench_prefix::BenchPrefixArgs),
    /// Continuous batching: aggregate decode tok/s and time to first token at several concurrent streams, with
    /// batching and one request at a time, interleaved (CPU, or the GPU with `--backend cuda`).
    Batch(nebula_service::cli::bench_batch::BenchBatchArgs),
    /// Vision: the tower's time to encode an image of each size and the time to first token of a one-image
    /// prompt (CPU, or the GPU with `--backend cuda`: tower and model both there).
    Vision(nebula_service::cli::bench_vision::BenchVisionArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Profile(args) => std::process::exit(nebula_service::profile::run(args).into()),
        Command::Serve(args) => {
            let config = nebula_service::ServerConfig::resolve(&args)?;
            Ok(nebula_service::serve(config)?)
        }
        Command::Openapi => {
            print!("{}", nebula_service::openapi::document());
            Ok(())
        }
        Command::Synth(args) => nebula_service::cli::synth::run(args),
        Command::Generate(args) => nebula_service::cli::generate::run(args),
        Command::Imatrix(args) => nebula_service::cli::imatrix::run(args),
        Command::Hotlist(args) => nebula_service::cli::hotlist::run(args),
        Command::Bench(BenchCommand::Model(args)) => nebula_service::cli::bench::run_model(args),
        Command::Bench(BenchCommand::Kernels(args)) => bench::run_kernels(&args),
        Command::Bench(BenchCommand::Mtp(args)) => nebula_service::cli::bench::run_mtp(args),
        Command::Bench(BenchCommand::Prefix(args)) => nebula_service::cli::bench_prefix::run_prefix(args),
        Command::Bench(BenchCommand::Batch(args)) => nebula_service::cli::bench_batch::run_batch(args),
        Command::Bench(BenchCommand::Vision(args)) => nebula_service::cli::bench_vision::run(args),
        Command::Convert {
            input,
            output,
            outtype,
            no_mtp,
            split_max_gib,
            name,
            recipe,
            recipe_from,
            imatrix,
            mmproj,
        } => {
            let imatrix = imatrix
                .map(|p| ImportanceMatrix::load(&p).with_context(|| format!("reading {}", p.display())))
                .transpose()?;
            if let Some(m) = &imatrix {
                println!("importance matrix {}: {} entries, {} chunks", m.path.display(), m.len(), m.chunks);
            }
            let recipe = match (recipe, recipe_from) {
                (Some(r), _) => Some(QuantRecipe::Named(r)),
                (None, Some(path)) => Some(
                    QuantRecipe::from_gguf(&path)
                        .with_context(|| format!("reading tensor types of {}", path.display()))?,
                ),
                (None, None) => None,
            };
            if input.is_file() {
                let output = output.context("a GGUF input is requantized: give --output")?;
                let recipe = recipe.context("a GGUF input is requantized: give --recipe or --recipe-from")?;
                let report = requantize_with(&input, &output, &recipe, imatrix.as_ref())
                    .with_context(|| format!("requantizing {} to {}", input.display(), output.display()))?;
                for f in &report.files {
                    println!("wrote {}", f.display());
                }
                println!(
                    "{} tensors, {:.1} MiB of tensor data",
                    report.tensors,
                    report.data_bytes as f64 / (1 << 20) as f64
                );
                return Ok(());
            }
            if let Some(mm) = &mmproj {
                let report = nebula_engine::convert::convert_mmproj(&input, mm, outtype, name.as_deref())
                    .with_context(|| format!("writing the vision tower of {} to {}", input.display(), mm.display()))?;
                println!(
                    "wrote {} ({} tensors, {:.1} MiB of tensor data)",
                    mm.display(),
                    report.tensors,
                    report.data_bytes as f64 / (1 << 20) as f64
                );
            }
            let Some(output) = output else { return Ok(()) };
            let opts = ConvertOptions {
                out_type: outtype,
                include_mtp: !no_mtp,
                split_max_bytes: split_max_gib.map(|g| (g * (1u64 << 30) as f64) as u64),
                name,
                recipe,
                imatrix,
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
            if !report.tokenizer {
                eprintln!(
                    "warning: {} has no tokenizer.json, so the GGUF has no tokenizer and `nebula serve` will refuse it; \
                     put tokenizer.json (and tokenizer_config.json, chat_template.jinja) beside the checkpoint and convert again",
                    input.display()
                );
            }
            Ok(())
        }
    }
}
