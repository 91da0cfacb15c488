//! The stored cursor of an at-least-once client: replaced atomically (write a temporary file,
//! fsync it, rename it over the old one, fsync the directory), so a crash leaves either the old
//! or the new cursor, never a torn one.

use std::{
    fs::{self, File},
    io::{self, Write},
    path::{Path, PathBuf},
};

pub struct CursorFile {
    path: PathBuf,
    temporary: PathBuf,
}

impl CursorFile {
    pub fn new(path: PathBuf) -> Self {
        let mut name = path
            .file_name()
            .map(|n| n.to_os_string())
            .unwrap_or_default();
        name.push(".tmp");
        Self {
            temporary: path.with_file_name(name),
            path,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored cursor; none when the file does not exist or is empty.
    pub fn load(&self) -> io::Result<Option<String>> {
        match fs::read_to_string(&self.path) {
            Ok(text) => Ok(Some(text.trim().to_string()).filter(|c| !c.is_empty())),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(error),
        }
    }

    pub fn store(&self, cursor: &str) -> io::Result<()> {
        let mut file = File::create(&self.temporary)?;
        file.write_all(cursor.as_bytes())?;
        file.sync_all()?;
        fs::rename(&self.temporary, &self.path)?;
        let directory = self
            .path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        File::open(directory)?.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stored cursor reads back; a missing or empty file is no cursor; no temporary is left.
    #[test]
    fn store_and_load() {
        let dir = std::env::temp_dir().join(format!("posthorn-cursor-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let store = CursorFile::new(dir.join("cursor"));
        assert_eq!(store.load().unwrap(), None);
        store.store("e.1.2-3").unwrap();
        store.store("e.1.2-4").unwrap();
        assert_eq!(store.load().unwrap().as_deref(), Some("e.1.2-4"));
        assert!(!dir.join("cursor.tmp").exists());
        fs::write(dir.join("cursor"), "\n").unwrap();
        assert_eq!(store.load().unwrap(), None);
        fs::remove_dir_all(&dir).unwrap();
    }
}
