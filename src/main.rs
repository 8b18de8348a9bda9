fn main() -> std::process::ExitCode {
    osdp_tui::cli::main()
}
