//! The `nebula` command.

fn main() -> anyhow::Result<()> {
    anyhow::bail!("nebula: no subcommands yet")
}
