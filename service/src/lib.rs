//! Nebula's HTTP service: the OpenAI-compatible API in front of the engine.

use std::path::PathBuf;

/// Arguments of `nebula serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// GGUF model to serve (split files: give the first part). Default: the embedded demo model.
    #[arg(long, env = "NEBULA_MODEL")]
    pub model: Option<PathBuf>,
}

/// Runs the server until it is stopped.
pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    anyhow::bail!("serve is not implemented yet ({args:?})")
}
