//! Protocol text every implementation of docs/protocol.md uses verbatim, whatever its language.
//!
//! The files are in `schemas/protocol/`; Rust takes them from there. Clients in other languages
//! are built and shipped without this crate, so they embed byte-for-byte copies, which the tests
//! below compare with the files (`every_copy_of_the_cas_script_is_cas_lua`).

/// The compare-and-set script every status write goes through (docs/protocol.md, "Writing a
/// status"): `schemas/protocol/cas.lua`, verbatim. `KEYS[1]` = job key, `KEYS[2]` = its
/// `:done` list; `ARGV` = status, result bytes, TTL in seconds. Returns 1 when written, 0 when
/// the stored status ranks at least as high (a terminal status is final; `running` may be
/// rewritten by a redelivery). A terminal write also pushes the status onto the `:done` list,
/// which waiters block on.
///
/// It is sent with `EVAL` (its source every time, never a SHA known in advance), so no party
/// depends on its exact bytes; the copies are kept identical so that there is one script to
/// read and to change.
pub const CAS_SCRIPT: &str = include_str!("../protocol/cas.lua");

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::CAS_SCRIPT;

    /// A copy of the script embedded in another file of the repository: the text after `open`
    /// (which occurs exactly once in the file) up to the next `close`. Each `open` ends where
    /// the language's string starts its value, so that text is the value itself (given what
    /// `the_cas_script_embeds_without_escaping` checks).
    struct Copy {
        path: &'static str,
        open: &'static str,
        close: &'static str,
    }

    const COPIES: &[Copy] = &[
        // The fenced block of "Writing a status".
        Copy { path: "docs/protocol.md", open: "```lua\n", close: "```" },
        // Python: `"""\` and a newline; the backslash joins the lines, so the value starts on
        // the next line.
        Copy { path: "clients/python/sandq/protocol.py", open: "CAS_SCRIPT = \"\"\"\\\n", close: "\"\"\"" },
        Copy { path: "clients/python/sandq_client.py", open: "CAS_SCRIPT = \"\"\"\\\n", close: "\"\"\"" },
        // TypeScript: a template literal opened with `` `\ `` and a newline (a line continuation:
        // the value starts on the next line).
        Copy { path: "clients/node/src/protocol.ts", open: "export const CAS_SCRIPT = `\\\n", close: "`" },
    ];

    /// The file itself, relative to the workspace root.
    const SOURCE: &str = "schemas/protocol/cas.lua";

    fn workspace() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("schemas/ has a parent").to_owned()
    }

    /// Where `found` first differs from the script, for the failure message.
    fn first_difference(found: &str) -> String {
        let (want, got): (Vec<&str>, Vec<&str>) = (CAS_SCRIPT.split('\n').collect(), found.split('\n').collect());
        let line = want.iter().zip(&got).position(|(w, g)| w != g).unwrap_or(want.len().min(got.len()));
        format!(
            "first difference at line {}: {SOURCE} has {:?}, the copy has {:?}",
            line + 1,
            want.get(line).copied().unwrap_or("<end of script>"),
            got.get(line).copied().unwrap_or("<end of copy>")
        )
    }

    /// The copies hold the script as plain text between their delimiters: no character in it is
    /// an escape or a delimiter in Python's `"""` strings, TypeScript's template literals or a
    /// Markdown fence, so the text between the delimiters is exactly the string's value.
    #[test]
    fn the_cas_script_embeds_without_escaping() {
        for bad in ["\\", "\"\"\"", "`", "${", "\r"] {
            assert!(!CAS_SCRIPT.contains(bad), "{SOURCE} contains {bad:?}: its copies in other languages would need escaping");
        }
        assert!(CAS_SCRIPT.ends_with("\n") && !CAS_SCRIPT.ends_with("\n\n"), "{SOURCE} must end with exactly one newline");
        // Its first line finds stray copies (`no_other_file_holds_a_copy_of_the_cas_script`).
        assert!(!CAS_SCRIPT.starts_with(char::is_whitespace) && !CAS_SCRIPT.starts_with("--"), "{SOURCE} must start with its code");
    }

    /// Every copy of the script in docs/protocol.md and the Python and Node SDKs is
    /// `schemas/protocol/cas.lua`, byte for byte.
    #[test]
    fn every_copy_of_the_cas_script_is_cas_lua() {
        let root = workspace();
        let mut failures = Vec::new();
        for copy in COPIES {
            let text = match std::fs::read_to_string(root.join(copy.path)) {
                Ok(text) => text,
                Err(e) => {
                    failures.push(format!("{}: cannot read it ({e}); if it moved, update COPIES in schemas/src/protocol.rs", copy.path));
                    continue;
                }
            };
            let opens: Vec<usize> = text.match_indices(copy.open).map(|(i, _)| i + copy.open.len()).collect();
            let [start] = opens[..] else {
                failures.push(format!("{}: {:?} occurs {} times, not once", copy.path, copy.open, opens.len()));
                continue;
            };
            let Some(len) = text[start..].find(copy.close) else {
                failures.push(format!("{}: no {:?} closes the script", copy.path, copy.close));
                continue;
            };
            let found = &text[start..start + len];
            if found != CAS_SCRIPT {
                failures.push(format!("{}: differs from {SOURCE}; {}", copy.path, first_difference(found)));
            }
        }
        assert!(failures.is_empty(), "copies of the compare-and-set script differ from {SOURCE}:\n{}", failures.join("\n"));
    }

    /// No file of the repository other than [`COPIES`] holds the script (found by its first
    /// line): a copy elsewhere would escape `every_copy_of_the_cas_script_is_cas_lua`.
    #[test]
    fn no_other_file_holds_a_copy_of_the_cas_script() {
        let root = workspace();
        let needle = CAS_SCRIPT.lines().next().expect("a first line").as_bytes();
        let known: Vec<PathBuf> = COPIES.iter().map(|c| root.join(c.path)).chain([root.join(SOURCE)]).collect();
        let mut stray = Vec::new();
        let mut dirs = vec![root.clone()];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).expect("read a directory of the repository") {
                let entry = entry.expect("a directory entry");
                let path = entry.path();
                let kind = entry.file_type().expect("a file type");
                let name = entry.file_name();
                let name = name.to_string_lossy();
                if kind.is_dir() {
                    // Version control, build output and installed dependencies.
                    if !(name.starts_with('.') || ["target", "node_modules", "dist", "__pycache__", "sandq-out"].contains(&name.as_ref())) {
                        dirs.push(path);
                    }
                } else if kind.is_file() && !known.contains(&path) {
                    let Ok(bytes) = std::fs::read(&path) else { continue };
                    if bytes.windows(needle.len()).any(|w| w == needle) {
                        stray.push(path.strip_prefix(&root).unwrap_or(&path).display().to_string());
                    }
                }
            }
        }
        assert!(
            stray.is_empty(),
            "files holding a copy of {SOURCE} that no test compares with it: {stray:?}; use sandq_schemas::protocol::CAS_SCRIPT in Rust, \
             or add the copy to COPIES in schemas/src/protocol.rs"
        );
    }
}
