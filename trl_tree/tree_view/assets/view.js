(function(){
  var body=document.body; body.classList.remove('nojs'); body.classList.add('js');
  function all(sel, root){return Array.prototype.slice.call((root||document).querySelectorAll(sel));}
  var buttons=all('.navbtn'), sections=all('section.prompt'), rows=all('tr.row'), current=null;
  function show(id){
    current=id;
    sections.forEach(function(s){s.classList.toggle('active', s.id===id);});
    buttons.forEach(function(b){b.classList.toggle('active', b.getAttribute('data-target')===id);});
  }
  buttons.forEach(function(b){b.addEventListener('click', function(){show(b.getAttribute('data-target'));});});
  all('.fold').forEach(function(f){f.addEventListener('click', function(e){
    e.stopPropagation();
    var s=f.closest('.node').nextElementSibling; if(!s||!s.classList.contains('sub')) return;
    s.classList.toggle('folded'); f.textContent=s.classList.contains('folded')?'▸':'▾';});});
  function nodeIn(sec, id){return sec.querySelector('.node[data-node="'+String(parseInt(id,10))+'"]');}
  function highlight(node){
    all('.onpath').forEach(function(n){n.classList.remove('onpath');});
    all('.picked').forEach(function(n){n.classList.remove('picked');});
    var sec=node.closest('section.prompt'), cur=node, ids={};
    node.classList.add('picked');
    while(cur){
      cur.classList.add('onpath'); ids[cur.getAttribute('data-node')]=1;
      var sub=cur.parentElement&&cur.parentElement.closest('.sub.folded');
      while(sub){sub.classList.remove('folded'); sub=sub.parentElement&&sub.parentElement.closest('.sub.folded');}
      var p=cur.getAttribute('data-parent'); if(p===null||p==='-1') break;
      cur=nodeIn(sec, p);
    }
    if(sec){all('.minimap [data-ref]', sec).forEach(function(a){
      var c=a.firstElementChild; if(c) c.classList.toggle('onpath', !!ids[a.getAttribute('data-ref')]);});}
  }
  function go(node){
    var sec=node.closest('section.prompt'); if(sec&&sec.id!==current) show(sec.id);
    highlight(node); node.scrollIntoView({block:'center'});
  }
  all('.node').forEach(function(n){n.addEventListener('click', function(e){
    if(e.target.closest('button, a')) return; highlight(n);});});
  all('[data-ref]').forEach(function(a){a.addEventListener('click', function(e){
    var sec=a.closest('section.prompt'); var n=sec&&nodeIn(sec, a.getAttribute('data-ref'));
    if(n){e.preventDefault(); go(n);}});});
  var pos=document.getElementById('leafpos');
  function visible(s){var b=buttons[sections.indexOf(s)]; return !b||!b.classList.contains('hidden');}
  function step(kind){
    var list=[]; sections.forEach(function(s){if(visible(s)) list=list.concat(all('.node[data-outcome="'+kind+'"]', s));});
    if(!list.length){ if(pos) pos.textContent='no '+kind+' leaf'+(buttons.length>1?' in the prompts shown':''); return; }
    var picked=document.querySelector('.node.picked'), at=list.indexOf(picked), i=0;
    if(at>=0){ i=(at+1)%list.length; }
    else { var sec=current&&document.getElementById(current);
      for(var j=0;j<list.length;j++){ if(list[j].closest('section.prompt')===sec){ i=j; break; } } }
    go(list[i]);
    if(pos) pos.textContent=kind+' leaf '+(i+1)+' of '+list.length;
  }
  ['rewarded','failed'].forEach(function(kind){var b=document.getElementById('next-'+kind);
    if(b) b.addEventListener('click', function(){step(kind);});});
  var search=document.getElementById('search'), fm=document.getElementById('f-mixed'),
      ff=document.getElementById('f-failed'), count=document.getElementById('shown-count');
  var items=buttons.length?buttons:rows, texts=(buttons.length?sections:rows).map(function(s){
    return s.textContent.toLowerCase();});
  function apply(){
    var q=search?search.value.trim().toLowerCase():'', n=0, first=null;
    items.forEach(function(b, i){
      var ok=(!fm||!fm.checked||b.getAttribute('data-mixed')==='1')&&(!ff||!ff.checked||b.getAttribute('data-failed')==='1')
        &&(!q||texts[i].indexOf(q)>=0);
      b.classList.toggle('hidden', !ok); if(ok){n++; if(first===null) first=b;}
    });
    if(count) count.textContent=n+' of '+items.length+(buttons.length?' prompts':' rows');
    if(buttons.length&&first&&document.querySelector('.navbtn.active.hidden')) show(first.getAttribute('data-target'));
  }
  [search, fm, ff].forEach(function(el){if(el) el.addEventListener('input', apply);});
  [fm, ff].forEach(function(el){if(el) el.addEventListener('change', apply);});
  var tpl=document.getElementById('show-tpl');
  if(tpl) tpl.addEventListener('change', function(){body.classList.toggle('showtpl', tpl.checked);});
  var nums=document.getElementById('all-numbers');
  if(nums) nums.addEventListener('change', function(){body.classList.toggle('allnums', nums.checked);});
  function fromHash(){
    var h=location.hash.slice(1), m=/^n-(\d+)-(\d+)$/.exec(h);
    if(/^prompt-\d+$/.test(h)&&document.getElementById(h)) show(h);
    else if(m){var sec=document.getElementById('prompt-'+m[1]), n=sec&&nodeIn(sec, m[2]); if(n) go(n);}
  }
  window.addEventListener('hashchange', fromHash);
  if(buttons.length){show(buttons[0].getAttribute('data-target')); fromHash(); apply();}
  else if(rows.length){apply();}
  else {body.classList.remove('js');}
})();
