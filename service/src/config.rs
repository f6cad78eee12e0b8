//! Settings of `nebula serve`: the command-line flags ([`ServeArgs`]) and the resolved [`ServerConfig`] the server
//! runs with. Later config sources (a `nebula.toml` file, more `NEBULA_*` variables) fill the same
//! [`ServerConfig`].

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

/// The demo model built into the binary (`models/nebula-demo.gguf`, made by `scripts/make_demo_model.py`), served
/// when no model is given so that a fresh clone and any copied binary work.
#[cfg(not(feature = "lean"))]
pub static EMBEDDED_DEMO_MODEL: &[u8] = include_bytes!("../../models/nebula-demo.gguf");
/// Built with the `lean` feature: no demo model inside (a smaller binary to carry to benchmark machines).
#[cfg(feature = "lean")]
pub static EMBEDDED_DEMO_MODEL: &[u8] = &[];

/// Label of the embedded demo model in logs and errors (it stands where a path would).
pub const EMBEDDED_DEMO_LABEL: &str = "<embedded>/nebula-demo.gguf";

/// Default context limit on the CPU path: the longest prompt + completion served when `--max-context` is not
/// given and the model's trained context is longer. It bounds the per-request state the CPU engine allocates.
pub const DEFAULT_CPU_MAX_CONTEXT: usize = 32_768;

/// Arguments of `nebula serve`. Every flag can also be set with the environment variable named in its help.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// GGUF model to serve (split files: give the first part). Default: the embedded demo model.
    #[arg(long, env = "NEBULA_MODEL")]
    pub model: Option<PathBuf>,
    /// Address to bind.
    #[arg(long, env = "NEBULA_HOST", default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    pub host: IpAddr,
    /// Port to bind (0: any free port).
    #[arg(long, env = "NEBULA_PORT", default_value_t = 8090)]
    pub port: u16,
    /// Longest prompt + completion served, in tokens. Default: the model's trained context length, capped at
    /// 32768 on the CPU. Prompts that do not fit are refused with 400, never truncated.
    #[arg(long, env = "NEBULA_MAX_CONTEXT", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_context: Option<u64>,
    /// Requests that may wait for the engine; more are refused with 429.
    #[arg(long = "queue", env = "NEBULA_QUEUE", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub queue_capacity: u64,
    /// Model id in the API (`model` of requests and `/v1/models`). Default: the GGUF's `general.name`.
    #[arg(long, env = "NEBULA_MODEL_ID")]
    pub model_id: Option<String>,
}

/// Where the served model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// The demo model built into the binary ([`EMBEDDED_DEMO_MODEL`]).
    EmbeddedDemo,
    /// A GGUF file on disk (split files: the first part).
    File(PathBuf),
}

impl ModelSource {
    /// How logs and errors name the model file.
    pub fn label(&self) -> String {
        match self {
            Self::EmbeddedDemo => EMBEDDED_DEMO_LABEL.to_owned(),
            Self::File(path) => path.display().to_string(),
        }
    }
}

/// Everything the server runs with.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to bind.
    pub host: IpAddr,
    /// Port to bind; 0 picks a free one (see [`crate::ServerHandle::addr`]).
    pub port: u16,
    /// The model to serve.
    pub model: ModelSource,
    /// Model id in the API; `None`: the GGUF's `general.name`.
    pub model_id: Option<String>,
    /// Longest prompt + completion in tokens; `None`: the model's context, capped at [`DEFAULT_CPU_MAX_CONTEXT`].
    pub max_context: Option<usize>,
    /// Requests that may wait for the engine before new ones get 429.
    pub queue_capacity: usize,
    /// After a shutdown signal, how long open requests may run before the server stops anyway.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    /// The embedded demo model on 127.0.0.1:8090.
    fn default() -> Self {
        Self {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 8090,
            model: ModelSource::EmbeddedDemo,
            model_id: None,
            max_context: None,
            queue_capacity: 64,
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

impl ServerConfig {
    /// The context limit handed to the engine (which also caps it at the model's own context length).
    pub fn engine_max_context(&self) -> usize {
        self.max_context.unwrap_or(DEFAULT_CPU_MAX_CONTEXT)
    }
}

impl From<ServeArgs> for ServerConfig {
    fn from(args: ServeArgs) -> Self {
        Self {
            host: args.host,
            port: args.port,
            model: args.model.map_or(ModelSource::EmbeddedDemo, ModelSource::File),
            model_id: args.model_id,
            max_context: args.max_context.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            queue_capacity: usize::try_from(args.queue_capacity).unwrap_or(usize::MAX),
            ..Self::default()
        }
    }
}
