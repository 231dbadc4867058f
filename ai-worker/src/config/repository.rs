//! The model repository (`model_repository`): a folder of model folders, each a
//! `config.toml` and its TorchScript file, read into [`ModelConfig`]s at start-up, so a model
//! is added by dropping a folder, with no Rust and no edit of the worker's config file.
//!
//! A model folder holds its model file directly (version 1), or numbered version folders as
//! Triton lays them out, `<name>/1/model.pt`, `<name>/2/model.pt`, of which its
//! `version_policy` picks those served (default: the newest). [`read_folder`] reads one model
//! folder again, for the repository API's loads and `poll` mode.
//!
//! Every error names the repository and the folder or file at fault, and reuses the checks of
//! a `[[models]]` entry with that location in place of `models[i]`.

use std::io::Read;
use std::path::{Path, PathBuf};

use figment::providers::{Format, Serialized, Toml};
use figment::Figment;

use super::{check_model_name, ModelConfig};

/// Most model folders a repository may hold (hidden folders not counted).
pub const MAX_MODEL_FOLDERS: usize = 256;
/// Largest `config.toml` of a model folder, in bytes.
pub const MAX_MODEL_CONFIG_BYTES: u64 = 64 * 1024;
/// The file of a model folder that declares the model.
pub const MODEL_CONFIG_FILE: &str = "config.toml";
/// Model files a folder's error lists by name; the rest are counted.
const LISTED_FILES: usize = 4;
/// Most version folders one model folder may hold.
pub const MAX_VERSION_FOLDERS: usize = 64;

/// The repository folder as errors show it: as configured, ending in `/`.
pub fn shown(folder: &Path) -> String {
    let text = folder.display().to_string();
    if text.ends_with('/') { text } else { format!("{text}/") }
}

/// What a repository holds.
pub struct Scanned {
    /// Each model version served, in folder name order (versions ascending), with the file
    /// that declared it (`<name>/config.toml`).
    pub models: Vec<(ModelConfig, String)>,
    /// The folders skipped for having no `config.toml`.
    pub skipped: Vec<String>,
}

/// Reads every model folder of `folder`. The error is the whole message, naming the
/// repository.
pub fn scan(folder: &Path) -> Result<Scanned, String> {
    let repo = shown(folder);
    let fail = |message: String| format!("model repository {repo}: {message}");
    let entries = std::fs::read_dir(folder).map_err(|e| fail(format!("cannot read the folder: {e}")))?;
    let mut folders = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| fail(format!("cannot list the folder: {e}")))?;
        let name = entry.file_name();
        // Hidden folders hold what tools leave (`.git`, editors' state), never a model.
        if name.to_string_lossy().starts_with('.') || !entry.path().is_dir() {
            continue;
        }
        if folders.len() == MAX_MODEL_FOLDERS {
            return Err(fail(format!("more than {MAX_MODEL_FOLDERS} model folders")));
        }
        folders.push((name, entry.path()));
    }
    folders.sort();
    let (mut models, mut skipped) = (Vec::new(), Vec::new());
    for (name, path) in folders {
        let Some(name) = name.to_str() else {
            return Err(fail(format!("folder {name:?} is not a valid model name: not UTF-8")));
        };
        check_model_name(name).map_err(|e| fail(format!("folder '{name}' is not a valid model name: it {e}")))?;
        let file = format!("{name}/{MODEL_CONFIG_FILE}");
        if !path.join(MODEL_CONFIG_FILE).exists() {
            skipped.push(name.to_string());
            continue;
        }
        for model in read_model(name, &path).map_err(|e| fail(format!("{file}: {e}")))? {
            models.push((model, file.clone()));
        }
    }
    Ok(Scanned { models, skipped })
}

/// The model versions the folder `name` of the repository `folder` serves now, by its
/// `config.toml` and version policy; the error is the whole message, naming the file at
/// fault. A folder without `config.toml` is an error here: it holds no model.
pub fn read_folder(folder: &Path, name: &str) -> Result<Vec<ModelConfig>, String> {
    let repo = shown(folder);
    check_model_name(name).map_err(|e| format!("'{name}' is not a valid model name: it {e}"))?;
    let dir = folder.join(name);
    if !dir.join(MODEL_CONFIG_FILE).is_file() {
        return Err(format!("model repository {repo} has no model '{name}' (no {name}/{MODEL_CONFIG_FILE})"));
    }
    read_model(name, &dir).map_err(|e| format!("model repository {repo}: {name}/{MODEL_CONFIG_FILE}: {e}"))
}

/// The names of the model folders (those with a `config.toml`) of `folder`, sorted; at most
/// [`MAX_MODEL_FOLDERS`].
pub fn model_names(folder: &Path) -> Result<Vec<String>, String> {
    let repo = shown(folder);
    let entries = std::fs::read_dir(folder).map_err(|e| format!("model repository {repo}: cannot read the folder: {e}"))?;
    let mut names = Vec::new();
    for entry in entries.flatten() {
        let Ok(name) = entry.file_name().into_string() else { continue };
        if name.starts_with('.') || check_model_name(&name).is_err() || !entry.path().join(MODEL_CONFIG_FILE).is_file() {
            continue;
        }
        if names.len() == MAX_MODEL_FOLDERS {
            return Err(format!("model repository {repo}: more than {MAX_MODEL_FOLDERS} model folders"));
        }
        names.push(name);
    }
    names.sort();
    Ok(names)
}

/// The numbered version folders of `dir`, ascending.
fn version_folders(dir: &Path) -> Result<Vec<(u64, PathBuf)>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("cannot list the model's folder: {e}"))?;
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot list the model's folder: {e}"))?;
        let name = entry.file_name();
        let Some(number) = name.to_str().filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())) else { continue };
        if !entry.path().is_dir() {
            continue;
        }
        let version: u64 = match number.parse() {
            Ok(v) if v > 0 && !number.starts_with('0') => v,
            _ => return Err(format!("version folder '{number}' must be a number from 1, without leading zeros")),
        };
        if found.len() == MAX_VERSION_FOLDERS {
            return Err(format!("more than {MAX_VERSION_FOLDERS} version folders"));
        }
        found.push((version, entry.path()));
    }
    found.sort();
    Ok(found)
}

/// Reads and checks the model of folder `dir`, named `name`: one entry per version its policy
/// serves (a folder without version folders: version 1). The error names the key at fault.
fn read_model(name: &str, dir: &Path) -> Result<Vec<ModelConfig>, String> {
    let versions = version_folders(dir)?;
    if versions.is_empty() {
        return Ok(vec![read_version(name, dir, dir)?]);
    }
    let text = read_bounded(&dir.join(MODEL_CONFIG_FILE))?;
    let policy: Option<super::VersionPolicy> =
        Figment::from(Toml::string(&text)).extract_inner("version_policy").ok();
    let numbers: Vec<u64> = versions.iter().map(|(v, _)| *v).collect();
    let chosen = policy.unwrap_or(super::VersionPolicy::Latest(1)).select(&numbers)?;
    let mut models = Vec::with_capacity(chosen.len());
    for (version, folder) in versions.into_iter().filter(|(v, _)| chosen.contains(v)) {
        let mut model = read_version(name, dir, &folder).map_err(|e| format!("version {version}: {e}"))?;
        model.version = version;
        models.push(model);
    }
    Ok(models)
}

/// The model declared by `dir`'s `config.toml` with its file in `files` (`dir` itself, or a
/// version folder): `path` resolved from there, else the one model file there.
fn read_version(name: &str, dir: &Path, files: &Path) -> Result<ModelConfig, String> {
    let text = read_bounded(&dir.join(MODEL_CONFIG_FILE))?;
    let figment = Figment::from(Toml::string(&text));
    // Read as a table first, so that a TOML syntax error is reported as such.
    let table: figment::value::Dict = figment.extract().map_err(figment_message)?;
    if table.contains_key("name") {
        return Err("name must not be set: a model's name is its folder's".into());
    }
    let path = if table.contains_key("path") {
        let path: PathBuf = figment.extract_inner("path").map_err(figment_message)?;
        // `join` keeps an absolute path as it is.
        let path = files.join(path);
        if !path.is_file() {
            return Err(format!("model file {} not found", path.display()));
        }
        path
    } else {
        default_model_file(files)?
    };
    // `path` is resolved here rather than read: an empty one stands in until it is set.
    let mut model: ModelConfig = figment
        .merge(Serialized::default("name", name))
        .merge(Serialized::default("path", ""))
        .extract()
        .map_err(figment_message)?;
    model.path = path;
    model.validate("")?;
    Ok(model)
}

/// A figment error as `key: problem`, its problems joined by `; ` (the file is named by the
/// caller, so figment's own "in TOML source string" is left out).
fn figment_message(e: figment::Error) -> String {
    let problems: Vec<String> = e
        .into_iter()
        .map(|e| if e.path.is_empty() { e.kind.to_string() } else { format!("{}: {}", e.path.join("."), e.kind) })
        .collect();
    problems.join("; ")
}

/// The text of `file`, refused past [`MAX_MODEL_CONFIG_BYTES`].
fn read_bounded(file: &Path) -> Result<String, String> {
    let opened = std::fs::File::open(file).map_err(|e| format!("cannot open: {e}"))?;
    let mut text = String::new();
    opened
        .take(MAX_MODEL_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read: {e}"))?;
    if text.len() as u64 > MAX_MODEL_CONFIG_BYTES {
        return Err(format!("larger than {MAX_MODEL_CONFIG_BYTES} bytes"));
    }
    Ok(text)
}

/// The one `*.pt` or `*.jit` file of `dir`, the model file of a folder whose config sets no
/// `path`.
fn default_model_file(dir: &Path) -> Result<PathBuf, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("cannot list the model's folder: {e}"))?;
    let mut found = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| format!("cannot list the model's folder: {e}"))?.path();
        if path.is_file() && matches!(path.extension().and_then(|e| e.to_str()), Some("pt" | "jit")) {
            found.push(path);
        }
    }
    found.sort();
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err("no path set and no *.pt or *.jit file in the folder: add the model file or set path".into()),
        n => {
            let mut listed: Vec<String> = found.iter().take(LISTED_FILES).map(|p| p.file_name().unwrap_or_default().to_string_lossy().into_owned()).collect();
            if n > LISTED_FILES {
                listed.push(format!("{} more", n - LISTED_FILES));
            }
            Err(format!("no path set and {n} model files in the folder ({}): set path to the one to load", listed.join(", ")))
        }
    }
}
